//! The per-layer KV cache: buffers with spare capacity, appended to in place.

use candle_core::{bail, Result, Tensor};

/// The keys and values seen so far, `(B, len, Hkv, D)` each.
///
/// Appending must not copy the whole cache every step (that would make decoding quadratic in
/// memory traffic), so the cache keeps buffers with spare capacity along the sequence axis:
/// new rows are written in place with `slice_set`, the attention reads a `narrow` view of the
/// filled part (no copy: the flash kernels take strided K/V), and the buffers double when full,
/// so each row is copied O(1) times on average.
#[derive(Clone, Debug)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
    min_capacity: usize,
}

impl Default for KvCache {
    fn default() -> Self {
        Self::new(256)
    }
}

impl KvCache {
    /// An empty cache whose first buffers hold at least `min_capacity` positions.
    pub fn new(min_capacity: usize) -> Self {
        Self { k: None, v: None, len: 0, min_capacity: min_capacity.max(1) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the current buffers hold before they must grow.
    pub fn capacity(&self) -> usize {
        self.k.as_ref().and_then(|k| k.dim(1).ok()).unwrap_or(0)
    }

    /// Forgets the contents (keeps the buffers for reuse).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Views of the cached keys and values, `(B, len, Hkv, D)`.
    pub fn kv(&self) -> Result<Option<(Tensor, Tensor)>> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) => Ok(Some((k.narrow(1, 0, self.len)?, v.narrow(1, 0, self.len)?))),
            _ => Ok(None),
        }
    }

    /// Appends `k` and `v` `(B, S, Hkv, D)` and returns views of everything cached so far.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, s, hkv, d) = k.dims4()?;
        if v.dims() != k.dims() || v.dtype() != k.dtype() {
            bail!("kv cache: k {:?} {:?} and v {:?} {:?} differ", k.dims(), k.dtype(), v.dims(), v.dtype())
        }
        if let Some(buf) = &self.k {
            let (bb, _, bh, bd) = buf.dims4()?;
            if (bb, bh, bd) != (b, hkv, d) || buf.dtype() != k.dtype() {
                bail!(
                    "kv cache: appending {:?} {:?} to a cache of {:?} {:?}",
                    k.dims(),
                    k.dtype(),
                    buf.dims(),
                    buf.dtype()
                )
            }
        }
        let needed = self.len + s;
        if needed > self.capacity() {
            let mut cap = self.capacity().max(self.min_capacity);
            while cap < needed {
                cap *= 2;
            }
            let grow = |old: &Option<Tensor>| -> Result<Tensor> {
                let buf = Tensor::zeros((b, cap, hkv, d), k.dtype(), k.device())?;
                if let Some(old) = old {
                    // The whole old buffer (filled part and spare rows) is contiguous, which
                    // slice_set needs; copying a few spare rows is cheaper than gathering.
                    buf.slice_set(old, 1, 0)?;
                }
                Ok(buf)
            };
            self.k = Some(grow(&self.k)?);
            self.v = Some(grow(&self.v)?);
        }
        let (kb, vb) = match (&self.k, &self.v) {
            (Some(kb), Some(vb)) => (kb, vb),
            _ => bail!("kv cache: buffers missing after growth"),
        };
        kb.slice_set(&k.contiguous()?, 1, self.len)?;
        vb.slice_set(&v.contiguous()?, 1, self.len)?;
        self.len = needed;
        Ok((kb.narrow(1, 0, needed)?, vb.narrow(1, 0, needed)?))
    }
}
