//! Block-sparse attention masks in PyTorch FlexAttention's `BlockMask` layout.
//!
//! The score matrix of every (batch, head) is cut into blocks of [`BLOCK_SIZE`] query rows ×
//! [`BLOCK_SIZE`] keys. For each query block a [`BlockMask`] lists the key blocks that are
//! *fully* visible (`full_kv_num_blocks`, `full_kv_indices`: no element test) and those that are
//! *partly* visible (`kv_num_blocks`, `kv_indices`: the element rule, a [`MaskSpec`], decides
//! inside them); key blocks in neither list are skipped, at no cost. The transposed lists
//! (`q_num_blocks`, `q_indices`, `full_q_*`: for each key block its query blocks) serve the
//! backward, which walks key blocks. The batch and head axes of every list may be 1 and then
//! broadcast over the call's.
//!
//! A mask is built once (from a rule, [`BlockMask::from_spec`], or from the key blocks a model
//! picked, [`BlockMask::from_block_indices`]) and reused by every call and layer with the same
//! lengths. Its tensors live on the device it was built for. The builders run on the host (they
//! read the rule's data there; a CUDA builder would not: see [`BlockMask::from_spec`]); attention
//! through a block mask runs forward and backward on the CPU and on CUDA's sm_90a kernels (f16 /
//! bf16, head dims 33 to 256; other CUDA calls are an error that says so: docs/api.md).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_flash::{flash_attn_with_options, BlockMask, FlashAttnOptions, MaskSpec};
//! let dev = Device::Cpu;
//! // Two documents of 200 and 100 tokens packed in one sequence, causal inside each.
//! let ids: Vec<u32> = (0..300).map(|t| u32::from(t >= 200)).collect();
//! let ids = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?; // [1, 300]
//! let spec = MaskSpec::causal().and(MaskSpec::same_document(&ids, &ids));
//! let mask = BlockMask::from_spec(&spec, 1, 1, 300, 300, &dev)?;
//! assert_eq!(mask.num_blocks(), (3, 3));
//! let q = Tensor::randn(0f32, 1., (1, 300, 4, 32), &dev)?;
//! let k = Tensor::randn(0f32, 1., (1, 300, 2, 32), &dev)?;
//! let out = flash_attn_with_options(&q, &k, &k, &FlashAttnOptions::new(0.17).block_mask(Some(&mask)))?;
//! assert_eq!(out.dims(), &[1, 300, 4, 32]);
//! // Query block 2 (rows 256..300, all of document 1) sees key block 1 in part (keys 200..255)
//! // and key block 2 in part (causal): key block 0 is never read.
//! assert_eq!(mask.kv_num_blocks().to_vec3::<i32>()?[0][0], [1, 2, 2]);
//! assert_eq!(mask.full_kv_num_blocks().to_vec3::<i32>()?[0][0], [0, 0, 0]);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{bail, DType, Device, Result, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Query rows and keys of one mask block: 128 × 128, FlexAttention's default block size, the
/// same on every device. It is a multiple of every tile of the CUDA kernels (64 or 128 query rows,
/// 32 to 128 keys), so a kernel tile lies in one block and is visited whole, skipped whole, or
/// masked by the rule. The CPU kernels cut their key tiles from the runs of key blocks that some
/// query block lists, so a key block that none lists is never read.
pub const BLOCK_SIZE: usize = 128;

/// An element rule: which key `j` query row `i` of sequence `b` sees, as data (the GPU kernels
/// cannot call a Rust closure; the CPU path, the reference and the builders evaluate the same
/// data through [`MaskEval`]).
///
/// Positions follow the crate's causal convention for `Sq ≠ Sk`: query row `i` sits at key
/// position `p = i + Sk - Sq` (the diagonal aligned bottom-right, as [`crate::FlashAttnOptions::causal`]).
/// Compose rules with [`MaskSpec::and`] / [`MaskSpec::or`].
#[derive(Clone, Debug)]
pub enum MaskSpec {
    /// `j <= p`.
    Causal,
    /// `p - left <= j <= p + right` (`None`: unbounded on that side), as
    /// [`crate::FlashAttnOptions::window`].
    Window { left: Option<usize>, right: Option<usize> },
    /// `q_doc[b][i] == k_doc[b][j]`: packed documents attend only within themselves. u32
    /// tensors of shape `[B or 1, Sq]` and `[B or 1, Sk]` (one document id per token; the ids
    /// need not be sorted or contiguous).
    SameDocument { q_doc: Tensor, k_doc: Tensor },
    /// Prefix-LM: `j <= p || j < prefix[b]`: every query sees the whole prefix of its sequence
    /// (bidirectional there), causal after it. u32 `[B or 1]` prefix lengths.
    PrefixLm { prefix: Tensor },
    /// Llama-4's chunks: `p / chunk == j / chunk` (a query before key 0, `p < 0`, sees none);
    /// `and(causal, chunked)` is Llama-4's chunked attention.
    Chunked { chunk: usize },
    /// `j < n`: the first `n` keys are visible to every query (Longformer's global tokens,
    /// StreamingLLM's sink tokens); `or(window, global)` is the usual combination.
    GlobalTokens { n: usize },
    /// Every rule holds (an empty list: every key is visible).
    And(Vec<MaskSpec>),
    /// Some rule holds (an empty list: no key is visible).
    Or(Vec<MaskSpec>),
}

impl MaskSpec {
    pub fn causal() -> Self {
        Self::Causal
    }

    pub fn window(left: Option<usize>, right: Option<usize>) -> Self {
        Self::Window { left, right }
    }

    /// Document ids, u32 `[B or 1, Sq]` for the queries and `[B or 1, Sk]` for the keys.
    pub fn same_document(q_doc: &Tensor, k_doc: &Tensor) -> Self {
        Self::SameDocument { q_doc: q_doc.clone(), k_doc: k_doc.clone() }
    }

    /// Prefix lengths, u32 `[B or 1]`.
    pub fn prefix_lm(prefix: &Tensor) -> Self {
        Self::PrefixLm { prefix: prefix.clone() }
    }

    pub fn chunked(chunk: usize) -> Self {
        Self::Chunked { chunk }
    }

    pub fn global_tokens(n: usize) -> Self {
        Self::GlobalTokens { n }
    }

    /// `self` and `other` both hold.
    pub fn and(self, other: MaskSpec) -> Self {
        Self::And(self.chained(other, true))
    }

    /// `self` or `other` holds.
    pub fn or(self, other: MaskSpec) -> Self {
        Self::Or(self.chained(other, false))
    }

    /// The rules of a chain of `and`s (`and`) or `or`s with `other` appended: `self`'s own list
    /// when it is already such a chain (flat, however long), else `self` alone.
    fn chained(self, other: MaskSpec, and: bool) -> Vec<MaskSpec> {
        let mut rules = match self {
            Self::And(rules) if and => rules,
            Self::Or(rules) if !and => rules,
            rule => vec![rule],
        };
        rules.push(other);
        rules
    }

    /// The tensors the rule reads (document ids, prefix lengths), in rule order.
    pub fn data_tensors(&self) -> Vec<&Tensor> {
        match self {
            Self::SameDocument { q_doc, k_doc } => vec![q_doc, k_doc],
            Self::PrefixLm { prefix } => vec![prefix],
            Self::And(rules) | Self::Or(rules) => rules.iter().flat_map(Self::data_tensors).collect(),
            _ => vec![],
        }
    }

    /// The rule with its data on the host, for lengths `(sq, sk)` and `batch` sequences (each
    /// data tensor's batch axis must be 1 or `batch`).
    pub fn evaluator(&self, batch: usize, (sq, sk): (usize, usize)) -> Result<MaskEval> {
        Ok(MaskEval { rule: Rule::read(self, batch, (sq, sk))?, sq, sk })
    }
}

/// A [`MaskSpec`] with its data read to the host, for one pair of lengths: the one function that
/// says whether an element is visible ([`MaskEval::visible`]), and each query row's visible keys
/// as intervals (what the builder classifies blocks with).
#[derive(Clone, Debug)]
pub struct MaskEval {
    rule: Rule,
    sq: usize,
    sk: usize,
}

/// A [`MaskSpec`] with its data read to the host (per-sequence data: one row per batch entry,
/// or one row for every sequence).
#[derive(Clone, Debug)]
enum Rule {
    Causal,
    Window(Option<usize>, Option<usize>),
    /// Per batch entry (one entry broadcasts): the query ids, the key ids, and each key id's
    /// runs of consecutive keys `[lo, hi)`.
    SameDocument {
        q_doc: Vec<Vec<u32>>,
        k_doc: Vec<Vec<u32>>,
        k_runs: Vec<HashMap<u32, Vec<(usize, usize)>>>,
    },
    PrefixLm(Vec<usize>),
    Chunked(usize),
    GlobalTokens(usize),
    And(Vec<Rule>),
    Or(Vec<Rule>),
}

/// Entry `b` of per-sequence data whose batch axis is 1 (broadcast) or the batch.
fn entry<T>(data: &[T], b: usize) -> &T {
    &data[if data.len() == 1 { 0 } else { b }]
}

impl Rule {
    fn read(spec: &MaskSpec, batch: usize, (sq, sk): (usize, usize)) -> Result<Rule> {
        Ok(match spec {
            MaskSpec::Causal => Rule::Causal,
            MaskSpec::Window { left, right } => Rule::Window(*left, *right),
            MaskSpec::SameDocument { q_doc, k_doc } => {
                let q_doc = read_u32_rows("the query document ids", q_doc, batch, sq)?;
                let k_doc = read_u32_rows("the key document ids", k_doc, batch, sk)?;
                let k_runs = k_doc
                    .iter()
                    .map(|ids| {
                        let mut runs: HashMap<u32, Vec<(usize, usize)>> = HashMap::new();
                        let mut start = 0;
                        for j in 1..=ids.len() {
                            if j == ids.len() || ids[j] != ids[start] {
                                runs.entry(ids[start]).or_default().push((start, j));
                                start = j;
                            }
                        }
                        runs
                    })
                    .collect();
                Rule::SameDocument { q_doc, k_doc, k_runs }
            }
            MaskSpec::PrefixLm { prefix } => {
                if prefix.dtype() != DType::U32 || prefix.rank() != 1 || ![1, batch].contains(&prefix.dim(0)?) {
                    bail!(
                        "candle-flash: the prefix lengths must be u32 of shape [{batch}] or [1], got {:?} {:?}",
                        prefix.dtype(),
                        prefix.dims()
                    )
                }
                Rule::PrefixLm(prefix.to_vec1::<u32>()?.into_iter().map(|p| p as usize).collect())
            }
            MaskSpec::Chunked { chunk } => {
                if *chunk == 0 {
                    bail!("candle-flash: the chunk size of a chunked mask must be at least 1, got 0")
                }
                Rule::Chunked(*chunk)
            }
            MaskSpec::GlobalTokens { n } => Rule::GlobalTokens(*n),
            MaskSpec::And(rules) => {
                Rule::And(rules.iter().map(|r| Rule::read(r, batch, (sq, sk))).collect::<Result<_>>()?)
            }
            MaskSpec::Or(rules) => {
                Rule::Or(rules.iter().map(|r| Rule::read(r, batch, (sq, sk))).collect::<Result<_>>()?)
            }
        })
    }

    fn visible(&self, b: usize, (i, pos): (usize, isize), j: usize) -> bool {
        let jp = j as isize;
        match self {
            Rule::Causal => jp <= pos,
            Rule::Window(left, right) => {
                left.is_none_or(|l| jp >= pos - l as isize) && right.is_none_or(|r| jp <= pos + r as isize)
            }
            Rule::SameDocument { q_doc, k_doc, .. } => entry(q_doc, b)[i] == entry(k_doc, b)[j],
            Rule::PrefixLm(prefix) => jp <= pos || j < *entry(prefix, b),
            Rule::Chunked(c) => pos.div_euclid(*c as isize) == jp.div_euclid(*c as isize),
            Rule::GlobalTokens(n) => j < *n,
            Rule::And(rules) => rules.iter().all(|r| r.visible(b, (i, pos), j)),
            Rule::Or(rules) => rules.iter().any(|r| r.visible(b, (i, pos), j)),
        }
    }

    /// The keys `[0, sk)` that row `i` (at position `pos`) sees, as sorted disjoint intervals.
    fn row_keys(&self, b: usize, (i, pos): (usize, isize), sk: usize) -> Vec<(usize, usize)> {
        // [lo, hi) in positions, cut to the keys.
        let span = |lo: isize, hi: isize| -> Vec<(usize, usize)> {
            let (lo, hi) = (lo.max(0), hi.min(sk as isize));
            if lo < hi {
                vec![(lo as usize, hi as usize)]
            } else {
                vec![]
            }
        };
        let unbounded = isize::MAX / 4;
        match self {
            Rule::Causal => span(0, pos + 1),
            Rule::Window(left, right) => span(
                left.map_or(0, |l| pos - l as isize),
                right.map_or(unbounded, |r| pos.saturating_add(r as isize).saturating_add(1)),
            ),
            Rule::SameDocument { q_doc, k_runs, .. } => {
                entry(k_runs, b).get(&entry(q_doc, b)[i]).cloned().unwrap_or_default()
            }
            Rule::PrefixLm(prefix) => span(0, (pos + 1).max(*entry(prefix, b) as isize)),
            Rule::Chunked(c) => {
                let start = pos.div_euclid(*c as isize) * *c as isize;
                span(start, start + *c as isize)
            }
            Rule::GlobalTokens(n) => span(0, (*n).min(sk) as isize),
            Rule::And(rules) => {
                rules.iter().fold(span(0, sk as isize), |acc, r| intersect(&acc, &r.row_keys(b, (i, pos), sk)))
            }
            Rule::Or(rules) => rules.iter().fold(vec![], |acc, r| union(&acc, &r.row_keys(b, (i, pos), sk))),
        }
    }
}

/// The intersection of two sorted lists of disjoint intervals.
fn intersect(a: &[(usize, usize)], b: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let (mut out, mut x, mut y) = (vec![], 0, 0);
    while x < a.len() && y < b.len() {
        let (lo, hi) = (a[x].0.max(b[y].0), a[x].1.min(b[y].1));
        if lo < hi {
            out.push((lo, hi));
        }
        if a[x].1 < b[y].1 {
            x += 1;
        } else {
            y += 1;
        }
    }
    out
}

/// The union of two sorted lists of disjoint intervals (touching intervals merged).
fn union(a: &[(usize, usize)], b: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut all: Vec<(usize, usize)> = a.iter().chain(b).copied().collect();
    all.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(all.len());
    for (lo, hi) in all {
        match out.last_mut() {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

/// u32 `[batch or 1, len]` per-token data as rows.
fn read_u32_rows(what: &str, t: &Tensor, batch: usize, len: usize) -> Result<Vec<Vec<u32>>> {
    match t.dims() {
        [b, n] if t.dtype() == DType::U32 && (*b == 1 || *b == batch) && *n == len => t.to_vec2::<u32>(),
        dims => bail!(
            "candle-flash: {what} must be u32 of shape [{batch}, {len}] or [1, {len}], got {:?} {dims:?}",
            t.dtype()
        ),
    }
}

impl MaskEval {
    /// Whether query row `i` of sequence `b`, query head `head`, sees key `j`. `b` indexes the
    /// rule's data (an axis of 1 broadcasts).
    pub fn visible(&self, b: usize, head: usize, i: usize, j: usize) -> bool {
        // No rule depends on the head yet; the layout does (a mask may differ per head), so the
        // element function takes it.
        let _ = head;
        self.rule.visible(b, (i, self.pos(i)), j)
    }

    /// The keys row `i` of sequence `b` sees, as sorted disjoint intervals `[lo, hi)` inside
    /// `[0, Sk)`: exactly the `j` with [`Self::visible`].
    pub fn row_keys(&self, b: usize, i: usize) -> Vec<(usize, usize)> {
        self.rule.row_keys(b, (i, self.pos(i)), self.sk)
    }

    /// The lengths `(Sq, Sk)` it was read for.
    pub fn seqlens(&self) -> (usize, usize) {
        (self.sq, self.sk)
    }

    /// Query row `i`'s key position (the bottom-right aligned diagonal).
    fn pos(&self, i: usize) -> isize {
        i as isize + self.sk as isize - self.sq as isize
    }
}

/// What one block of a mask holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum BlockClass {
    /// No element visible: not listed, never visited.
    Empty = 0,
    /// Some elements visible: listed in `kv_indices` / `q_indices`, the rule decides per element.
    Partial = 1,
    /// Every element visible: listed in `full_kv_indices` / `full_q_indices`, no element test.
    Full = 2,
}

/// A block-sparse mask in FlexAttention's layout (module documentation). Every list is i32;
/// `Qb = ceil(Sq / 128)` query blocks, `Kb = ceil(Sk / 128)` key blocks; `B` and `H` are the
/// batch and head counts it was built for, each 1 (broadcast) or the call's:
///
/// - `kv_num_blocks` `[B, H, Qb]`, `kv_indices` `[B, H, Qb, Kb]`: each query block's partly
///   visible key blocks (ascending; entries past the count are 0 and never read);
/// - `full_kv_num_blocks` `[B, H, Qb]`, `full_kv_indices` `[B, H, Qb, Kb]`: its fully visible ones;
/// - `q_num_blocks` `[B, H, Kb]`, `q_indices` `[B, H, Kb, Qb]`, `full_q_num_blocks`,
///   `full_q_indices`: the same lists transposed (each key block's query blocks).
///
/// Cloning is cheap (the tensors and the host copy are shared).
#[derive(Clone)]
pub struct BlockMask {
    /// Each query block's key blocks (`kv_*`, `full_kv_*`).
    kv: BlockLists,
    /// Each key block's query blocks (`q_*`, `full_q_*`).
    q: BlockLists,
    seqlen_q: usize,
    seqlen_k: usize,
    spec: Option<MaskSpec>,
    /// The rule read to the host (the builders read it anyway), for the CPU kernels.
    eval: Option<Arc<MaskEval>>,
    /// The block classes read back from the lists, on first use by the CPU path.
    host: Arc<OnceLock<Arc<HostBlocks>>>,
}

/// One direction's lists: for every block of one axis (the rows) its partly and fully visible
/// blocks of the other (`width` of them), as counts `[B, H, rows]` and ascending indices
/// `[B, H, rows, width]`.
#[derive(Clone)]
struct BlockLists {
    num_blocks: Tensor,
    indices: Tensor,
    full_num_blocks: Tensor,
    full_indices: Tensor,
}

impl std::fmt::Debug for BlockMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMask")
            .field("batch_heads", &self.batch_heads())
            .field("seqlen_q", &self.seqlen_q)
            .field("seqlen_k", &self.seqlen_k)
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl BlockMask {
    /// The mask of `spec` for `batch` sequences and `heads` heads (each may be 1 to broadcast
    /// over the call's: no rule depends on the head, so 1 is the usual choice; the rule's data
    /// must have a batch axis of 1 or `batch`), query length `seqlen_q` and key length
    /// `seqlen_k`, its tensors on `device`. Every block is classified exactly: full only when
    /// every element is visible, empty only when none is (the document ids and prefix lengths
    /// are read for it).
    ///
    /// The builder runs on the host: it reads the rule's data there and copies the lists to
    /// `device` (a host synchronisation when the rule's data is on a GPU). A CUDA builder (one
    /// thread block per (batch, query block), the rule evaluated on the device with no host
    /// synchronisation, as the kernels evaluate it: kernels/common/block_sparse.cuh) would go here,
    /// behind the `cuda` feature.
    pub fn from_spec(
        spec: &MaskSpec,
        batch: usize,
        heads: usize,
        seqlen_q: usize,
        seqlen_k: usize,
        device: &Device,
    ) -> Result<Self> {
        check_counts(batch, heads)?;
        let eval = spec.evaluator(batch, (seqlen_q, seqlen_k))?;
        let (qb, kb) = (seqlen_q.div_ceil(BLOCK_SIZE), seqlen_k.div_ceil(BLOCK_SIZE));
        let mut classes = Vec::with_capacity(batch * heads * qb * kb);
        for b in 0..batch {
            let per_batch = classify(&eval, b);
            for _ in 0..heads {
                classes.extend_from_slice(&per_batch);
            }
        }
        Self::from_classes(&classes, (batch, heads), (seqlen_q, seqlen_k), Some((spec, eval)), device)
    }

    /// The mask of the key blocks a model picked (MoBA, NSA top-k): `indices` u32 or i32
    /// `(B, H, Qb, k)` (`B`, `H` each 1 or the call's; `Qb = ceil(seqlen_q / 128)`) lists up to
    /// `k` key blocks for each query block. Duplicates count once; entries outside the key
    /// blocks (negative, or `>= ceil(seqlen_k / 128)`) are skipped. Inside the listed blocks
    /// `spec` (usually causal) decides per element: a listed block the rule leaves empty is
    /// dropped, one it leaves whole is full. Without a rule every listed block is full. The
    /// lists live on `indices`' device (read to the host to build them, for now: see
    /// [`Self::from_spec`]).
    pub fn from_block_indices(
        indices: &Tensor,
        spec: Option<&MaskSpec>,
        seqlen_q: usize,
        seqlen_k: usize,
    ) -> Result<Self> {
        let (qb, kb) = (seqlen_q.div_ceil(BLOCK_SIZE), seqlen_k.div_ceil(BLOCK_SIZE));
        let (batch, heads, width) = match indices.dims() {
            &[b, h, q, k] if q == qb => (b, h, k),
            dims => bail!(
                "candle-flash: block indices must have shape (B, H, {qb}, k) for seqlen_q {seqlen_q} \
                 ({qb} query blocks of {BLOCK_SIZE}), got {dims:?}"
            ),
        };
        check_counts(batch, heads)?;
        let picked: Vec<i64> = match indices.dtype() {
            DType::U32 => indices.flatten_all()?.to_vec1::<u32>()?.into_iter().map(i64::from).collect(),
            DType::I32 => indices.flatten_all()?.to_vec1::<i32>()?.into_iter().map(i64::from).collect(),
            dt => bail!("candle-flash: block indices must be u32 or i32, got {dt:?}"),
        };
        let eval = spec.map(|s| s.evaluator(batch, (seqlen_q, seqlen_k))).transpose()?;
        let mut classes = vec![BlockClass::Empty; batch * heads * qb * kb];
        for b in 0..batch {
            let allowed = match &eval {
                Some(eval) => classify(eval, b),
                None => vec![BlockClass::Full; qb * kb],
            };
            for h in 0..heads {
                for q in 0..qb {
                    let row = ((b * heads + h) * qb + q) * kb;
                    let list = &picked[((b * heads + h) * qb + q) * width..][..width];
                    for &key_block in list.iter().filter(|&&x| 0 <= x && x < kb as i64) {
                        let key_block = key_block as usize;
                        classes[row + key_block] = allowed[q * kb + key_block];
                    }
                }
            }
        }
        let spec = spec.zip(eval);
        Self::from_classes(&classes, (batch, heads), (seqlen_q, seqlen_k), spec, indices.device())
    }

    /// The lists of a dense class array `(B, H, Qb, Kb)`.
    fn from_classes(
        classes: &[BlockClass],
        (batch, heads): (usize, usize),
        (seqlen_q, seqlen_k): (usize, usize),
        spec: Option<(&MaskSpec, MaskEval)>,
        device: &Device,
    ) -> Result<Self> {
        let (qb, kb) = (seqlen_q.div_ceil(BLOCK_SIZE), seqlen_k.div_ceil(BLOCK_SIZE));
        // The lists of `class` along the rows of a (rows × width) view of each (b, h)'s classes
        // (transposed: the key blocks are the rows).
        let lists = |class: BlockClass, (rows, width): (usize, usize), transposed: bool| {
            let mut counts = vec![0i32; batch * heads * rows];
            let mut indices = vec![0i32; batch * heads * rows * width];
            for bh in 0..batch * heads {
                let one = &classes[bh * qb * kb..(bh + 1) * qb * kb];
                for r in 0..rows {
                    let list = &mut indices[(bh * rows + r) * width..][..width];
                    let mut n = 0;
                    for c in 0..width {
                        let at = if transposed { c * kb + r } else { r * kb + c };
                        if one[at] == class {
                            list[n] = c as i32;
                            n += 1;
                        }
                    }
                    counts[bh * rows + r] = n as i32;
                }
            }
            let counts = Tensor::from_vec(counts, (batch, heads, rows), device)?;
            let indices = Tensor::from_vec(indices, (batch, heads, rows, width), device)?;
            Ok::<_, candle_core::Error>((counts, indices))
        };
        let both = |dims: (usize, usize), transposed: bool| {
            let (num_blocks, indices) = lists(BlockClass::Partial, dims, transposed)?;
            let (full_num_blocks, full_indices) = lists(BlockClass::Full, dims, transposed)?;
            Ok::<_, candle_core::Error>(BlockLists { num_blocks, indices, full_num_blocks, full_indices })
        };
        let (kv, q) = (both((qb, kb), false)?, both((kb, qb), true)?);
        let (spec, eval) = match spec {
            Some((spec, eval)) => (Some(spec.clone()), Some(Arc::new(eval))),
            None => (None, None),
        };
        Ok(Self { kv, q, seqlen_q, seqlen_k, spec, eval, host: Arc::default() })
    }

    /// i32 `[B, H, Qb]`: each query block's number of partly visible key blocks.
    pub fn kv_num_blocks(&self) -> &Tensor {
        &self.kv.num_blocks
    }
    /// i32 `[B, H, Qb, Kb]`: each query block's partly visible key blocks, ascending.
    pub fn kv_indices(&self) -> &Tensor {
        &self.kv.indices
    }
    /// i32 `[B, H, Qb]`: each query block's number of fully visible key blocks.
    pub fn full_kv_num_blocks(&self) -> &Tensor {
        &self.kv.full_num_blocks
    }
    /// i32 `[B, H, Qb, Kb]`: each query block's fully visible key blocks, ascending.
    pub fn full_kv_indices(&self) -> &Tensor {
        &self.kv.full_indices
    }
    /// i32 `[B, H, Kb]`: each key block's number of partly visible query blocks.
    pub fn q_num_blocks(&self) -> &Tensor {
        &self.q.num_blocks
    }
    /// i32 `[B, H, Kb, Qb]`: each key block's partly visible query blocks, ascending.
    pub fn q_indices(&self) -> &Tensor {
        &self.q.indices
    }
    /// i32 `[B, H, Kb]`: each key block's number of fully visible query blocks.
    pub fn full_q_num_blocks(&self) -> &Tensor {
        &self.q.full_num_blocks
    }
    /// i32 `[B, H, Kb, Qb]`: each key block's fully visible query blocks, ascending.
    pub fn full_q_indices(&self) -> &Tensor {
        &self.q.full_indices
    }
    /// The query and key lengths it was built for.
    pub fn seqlens(&self) -> (usize, usize) {
        (self.seqlen_q, self.seqlen_k)
    }
    /// Its batch and head counts (each 1 where it broadcasts).
    pub fn batch_heads(&self) -> (usize, usize) {
        (self.kv.num_blocks.dims()[0], self.kv.num_blocks.dims()[1])
    }
    /// The number of query and key blocks.
    pub fn num_blocks(&self) -> (usize, usize) {
        (self.seqlen_q.div_ceil(BLOCK_SIZE), self.seqlen_k.div_ceil(BLOCK_SIZE))
    }
    /// The element rule applied in the partly visible blocks (None: every listed block is full).
    pub fn spec(&self) -> Option<&MaskSpec> {
        self.spec.as_ref()
    }
    pub fn device(&self) -> &Device {
        self.kv.num_blocks.device()
    }

    /// The fraction of the score matrix's blocks that are visited (partial or full), over every
    /// (batch, head) of the mask: what the attention through it costs relative to dense.
    pub fn density(&self) -> Result<f64> {
        // (the counts read to the host: not every device casts i32)
        let count = |t: &Tensor| -> Result<f64> {
            Ok(t.flatten_all()?.to_vec1::<i32>()?.into_iter().map(f64::from).sum::<f64>())
        };
        let listed = count(&self.kv.num_blocks)? + count(&self.kv.full_num_blocks)?;
        let (qb, kb) = self.num_blocks();
        let (b, h) = self.batch_heads();
        Ok(listed / (b * h * qb * kb).max(1) as f64)
    }

    /// The block classes read back from the lists (on the first call; shared by clones), with
    /// the rule's host form: what the CPU kernels and the reference read.
    pub(crate) fn host(&self) -> Result<Arc<HostBlocks>> {
        if let Some(host) = self.host.get() {
            return Ok(host.clone());
        }
        let host = Arc::new(HostBlocks::read(self)?);
        Ok(self.host.get_or_init(|| host).clone())
    }
}

fn check_counts(batch: usize, heads: usize) -> Result<()> {
    if batch == 0 || heads == 0 {
        bail!(
            "candle-flash: a block mask needs at least one batch entry and one head, got batch {batch}, heads {heads}"
        )
    }
    Ok(())
}

/// Every block's class for sequence `b` of the rule's data, `(Qb, Kb)` row-major: the visible
/// elements counted per block from each row's key intervals (O(Sq · (intervals + Kb))), a block
/// full when the count is its area, empty when 0.
fn classify(eval: &MaskEval, b: usize) -> Vec<BlockClass> {
    let (sq, sk) = eval.seqlens();
    let (qb, kb) = (sq.div_ceil(BLOCK_SIZE), sk.div_ceil(BLOCK_SIZE));
    let mut classes = Vec::with_capacity(qb * kb);
    let mut counts = vec![0usize; kb];
    for q in 0..qb {
        counts.fill(0);
        let rows = q * BLOCK_SIZE..((q + 1) * BLOCK_SIZE).min(sq);
        let height = rows.len();
        for i in rows {
            for (lo, hi) in eval.row_keys(b, i) {
                for (c, count) in counts.iter_mut().enumerate().take((hi - 1) / BLOCK_SIZE + 1).skip(lo / BLOCK_SIZE) {
                    *count += hi.min((c + 1) * BLOCK_SIZE) - lo.max(c * BLOCK_SIZE);
                }
            }
        }
        classes.extend(counts.iter().enumerate().map(|(c, &n)| {
            let area = height * (((c + 1) * BLOCK_SIZE).min(sk) - c * BLOCK_SIZE);
            match n {
                0 => BlockClass::Empty,
                n if n == area => BlockClass::Full,
                _ => BlockClass::Partial,
            }
        }));
    }
    classes
}

/// A mask's classes on the host, dense: `(B, H, Qb, Kb)` from the kv lists (for the forward,
/// which walks query blocks) and `(B, H, Kb, Qb)` from the q lists (for the backward, which walks
/// key blocks), and the rule of the partial blocks.
#[derive(Debug)]
pub(crate) struct HostBlocks {
    batch: usize,
    heads: usize,
    q_blocks: usize,
    k_blocks: usize,
    kv_class: Vec<BlockClass>,
    q_class: Vec<BlockClass>,
    eval: Option<Arc<MaskEval>>,
}

impl HostBlocks {
    fn read(mask: &BlockMask) -> Result<Self> {
        let (batch, heads) = mask.batch_heads();
        let (q_blocks, k_blocks) = mask.num_blocks();
        let read = |lists: &BlockLists, (rows, width): (usize, usize), what| {
            let mut class = vec![BlockClass::Empty; batch * heads * rows * width];
            let partial = (BlockClass::Partial, (&lists.num_blocks, &lists.indices));
            let full = (BlockClass::Full, (&lists.full_num_blocks, &lists.full_indices));
            for (kind, (counts, indices)) in [partial, full] {
                let counts = counts.flatten_all()?.to_vec1::<i32>()?;
                let indices = indices.flatten_all()?.to_vec1::<i32>()?;
                if counts.len() != batch * heads * rows || indices.len() != counts.len() * width {
                    bail!(
                        "candle-flash: the {what} lists of a block mask have {} counts and {} indices",
                        counts.len(),
                        indices.len()
                    )
                }
                for (row, &n) in counts.iter().enumerate() {
                    let Ok(n) = usize::try_from(n) else { bail!("candle-flash: block mask {what} count {n} < 0") };
                    if n > width {
                        bail!("candle-flash: block mask {what} count {n} exceeds the {width} blocks")
                    }
                    for &c in &indices[row * width..row * width + n] {
                        match usize::try_from(c) {
                            Ok(c) if c < width => class[row * width + c] = kind,
                            _ => bail!("candle-flash: block mask {what} index {c} is not a block (0..{width})"),
                        }
                    }
                }
            }
            Ok::<_, candle_core::Error>(class)
        };
        let kv_class = read(&mask.kv, (q_blocks, k_blocks), "kv")?;
        let q_class = read(&mask.q, (k_blocks, q_blocks), "q")?;
        Ok(Self { batch, heads, q_blocks, k_blocks, kv_class, q_class, eval: mask.eval.clone() })
    }

    /// The mask's (batch, head) entry for the call's sequence `b` and query head `h`.
    fn entry(&self, b: usize, h: usize) -> usize {
        let b = if self.batch == 1 { 0 } else { b };
        let h = if self.heads == 1 { 0 } else { h };
        b * self.heads + h
    }

    /// The classes of every key block for query block `qb` of sequence `b`, head `h`.
    pub(crate) fn kv_row(&self, b: usize, h: usize, qb: usize) -> &[BlockClass] {
        let row = self.entry(b, h) * self.q_blocks + qb;
        &self.kv_class[row * self.k_blocks..(row + 1) * self.k_blocks]
    }

    /// The classes of every query block for key block `kb` of sequence `b`, head `h`.
    pub(crate) fn q_row(&self, b: usize, h: usize, kb: usize) -> &[BlockClass] {
        let row = self.entry(b, h) * self.k_blocks + kb;
        &self.q_class[row * self.q_blocks..(row + 1) * self.q_blocks]
    }

    /// Whether the rule shows element (i, j) of a partial block (no rule: every one).
    pub(crate) fn partial_visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let b = if self.batch == 1 { 0 } else { b };
        self.eval.as_ref().is_none_or(|e| e.visible(b, h, i, j))
    }

    /// Whether query row `i` of sequence `b`, head `h` sees key `j` through the mask: the dense
    /// element mask of the kv lists and the rule (the reference's).
    pub(crate) fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        match self.kv_row(b, h, i / BLOCK_SIZE)[j / BLOCK_SIZE] {
            BlockClass::Empty => false,
            BlockClass::Full => true,
            BlockClass::Partial => self.partial_visible(b, h, i, j),
        }
    }

    /// Whether the mask has a head axis of its own (it differs per head).
    pub(crate) fn per_head(&self) -> bool {
        self.heads > 1
    }
}

/// The key tiles `(j0, cols)` of the runs of consecutive key blocks `c < num_blocks` with
/// `listed(c)`, each run cut to `[lo, hi)` and cut into tiles of `tile` keys from its start: a
/// tile never holds a key of an unlisted block (the CPU kernels' walk over a mask's keys).
pub(crate) fn listed_key_tiles(
    num_blocks: usize,
    listed: impl Fn(usize) -> bool,
    (lo, hi): (usize, usize),
    tile: usize,
) -> Vec<(usize, usize)> {
    let mut tiles = vec![];
    let mut c = 0;
    while c < num_blocks {
        let start = c;
        while c < num_blocks && listed(c) {
            c += 1;
        }
        let (run_lo, run_hi) = ((start * BLOCK_SIZE).max(lo), (c * BLOCK_SIZE).min(hi));
        tiles.extend((run_lo..run_hi).step_by(tile).map(|j0| (j0, tile.min(run_hi - j0))));
        c += 1; // past the unlisted block that ended the run (or the end)
    }
    tiles
}
