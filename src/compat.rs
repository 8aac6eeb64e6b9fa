//! Drop-in signatures of other candle attention crates, mapped onto this crate's functions.

/// candle-flash-attn-v3 0.11's functions: the FlashAttention-3 signatures, which add
/// `use_gqa_packing: bool` to candle-flash-attn's. The flag is accepted and ignored: our
/// kernels choose how to pack GQA heads themselves (the CPU path always packs a KV head's
/// query heads into one tile). Switch with `use candle_flash::compat::v3 as candle_flash_attn_v3;`.
pub mod v3 {
    use candle_core::{Result, Tensor};

    /// See [`crate::flash_attn`].
    pub fn flash_attn(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        softmax_scale: f32,
        causal: bool,
        _use_gqa_packing: bool,
    ) -> Result<Tensor> {
        crate::flash_attn(q, k, v, softmax_scale, causal)
    }

    /// See [`crate::flash_attn_windowed`].
    pub fn flash_attn_windowed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        softmax_scale: f32,
        window_size_left: Option<usize>,
        window_size_right: Option<usize>,
        _use_gqa_packing: bool,
    ) -> Result<Tensor> {
        crate::flash_attn_windowed(q, k, v, softmax_scale, window_size_left, window_size_right)
    }

    /// See [`crate::flash_attn_alibi`].
    pub fn flash_attn_alibi(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        alibi_slopes: &Tensor,
        softmax_scale: f32,
        causal: bool,
        _use_gqa_packing: bool,
    ) -> Result<Tensor> {
        crate::flash_attn_alibi(q, k, v, alibi_slopes, softmax_scale, causal)
    }

    /// See [`crate::flash_attn_alibi_windowed`].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attn_alibi_windowed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        alibi_slopes: &Tensor,
        softmax_scale: f32,
        window_size_left: Option<usize>,
        window_size_right: Option<usize>,
        _use_gqa_packing: bool,
    ) -> Result<Tensor> {
        crate::flash_attn_alibi_windowed(q, k, v, alibi_slopes, softmax_scale, window_size_left, window_size_right)
    }

    /// See [`crate::flash_attn_varlen`].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attn_varlen(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        softmax_scale: f32,
        causal: bool,
        _use_gqa_packing: bool,
    ) -> Result<Tensor> {
        crate::flash_attn_varlen(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    }

    /// See [`crate::flash_attn_varlen_windowed`].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attn_varlen_windowed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        softmax_scale: f32,
        window_size_left: Option<usize>,
        window_size_right: Option<usize>,
        _use_gqa_packing: bool,
    ) -> Result<Tensor> {
        crate::flash_attn_varlen_windowed(
            q,
            k,
            v,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            window_size_left,
            window_size_right,
        )
    }

    /// See [`crate::flash_attn_varlen_alibi`].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attn_varlen_alibi(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        alibi_slopes: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        softmax_scale: f32,
        causal: bool,
        _use_gqa_packing: bool,
    ) -> Result<Tensor> {
        crate::flash_attn_varlen_alibi(
            q,
            k,
            v,
            alibi_slopes,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            causal,
        )
    }

    /// See [`crate::flash_attn_varlen_alibi_windowed`].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attn_varlen_alibi_windowed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        alibi_slopes: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        softmax_scale: f32,
        window_size_left: Option<usize>,
        window_size_right: Option<usize>,
        _use_gqa_packing: bool,
    ) -> Result<Tensor> {
        crate::flash_attn_varlen_alibi_windowed(
            q,
            k,
            v,
            alibi_slopes,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            window_size_left,
            window_size_right,
        )
    }
}
