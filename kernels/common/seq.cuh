// Where one sequence of the batch lives, and the pointers to its rows in every tensor of the
// contract (flash_api.h). The only place that turns (batch, head, row) into an address: kernels
// ask SeqInfo for "row 0 of head h" of a tensor and add row * row_stride themselves for query-side
// rows; key rows (contiguous or paged) go through key_offset / load_keys.
#pragma once
#include "../flash_api.h"
#include "tile.cuh"

namespace cf {

// Which K/V a kernel reads (SeqInfo's constructor, QueryBlockWork): kContiguous (the
// default: the backward, code that only needs the query side, and the sm80 forward's contiguous
// instantiation, all at their register limits) or kAny (paged or not, decided at run time from
// block_table).
enum class KvPath { kAny, kContiguous };
template <KvPath kPath>
struct KvKind {};

struct SeqInfo {
    int b;                    // sequence index
    int sq, sk;               // this sequence's lengths
    int64_t q_row0, k_row0;   // index of its row 0 among all rows (b*seqlen, or cu_seqlens[b]; 0 paged)
    bool q_varlen, k_varlen;

    // Varlen offsets are device data the host does not check by default (no synchronisation per
    // call): clamp them so that a bad table can only give wrong rows, never an access outside
    // the tensors. Offsets are clamped to [0, total]; a decreasing pair is an empty sequence; a
    // length above the maximum the grid was sized for is cut to it.
    static __device__ __forceinline__ void span(const uint32_t* cu, int b, int64_t total, int max_len,
                                                int64_t& row0, int& len) {
        const int64_t s = min((int64_t)cu[b], total);
        const int64_t e = min((int64_t)cu[b + 1], total);
        row0 = s;
        len = e > s ? (int)min(e - s, (int64_t)max_len) : 0;
    }

    // Forward kernels that read paged K/V construct it with KvKind<kAny>; the default carries no
    // paged code.
    template <KvPath kPath = KvPath::kContiguous>
    __device__ __forceinline__ SeqInfo(const CfFwdParams& p, int b_, KvKind<kPath> = {}) : b(b_) {
        q_varlen = p.cu_seqlens_q != nullptr;
        k_varlen = p.cu_seqlens_k != nullptr;
        if (q_varlen) {
            span(p.cu_seqlens_q, b, p.total_q, p.seqlen_q, q_row0, sq);
        } else {
            q_row0 = int64_t(b) * p.seqlen_q;
            sq = p.seqlen_q;
        }
        if (kPath == KvPath::kAny && p.block_table != nullptr) {
            // Paged: cu_seqlens_k only gives lengths (pages may be shared between sequences, so
            // the offsets need not stay below the cache's rows); the table addresses the rows
            // (key_offset). A cache without pages holds no key.
            const int64_t s = p.cu_seqlens_k[b], e = p.cu_seqlens_k[b + 1];
            k_row0 = 0;
            sk = (e > s && p.num_blocks > 0) ? (int)min(e - s, (int64_t)p.seqlen_k) : 0;
        } else if (k_varlen) {
            span(p.cu_seqlens_k, b, p.total_k, p.seqlen_k, k_row0, sk);
        } else {
            k_row0 = int64_t(b) * p.seqlen_k;
            sk = p.seqlen_k;
        }
    }

    // Element offset of key j (0 <= j < sk) from row 0 of its KV head in K or V: j rows down,
    // or, paged, row j % page_block_size of page block_table[b][j / page_block_size]
    // (page_stride = the tensor's stride between pages). The one place a key index becomes an
    // address. Table entries are device data the host does not check by default: an entry
    // outside [0, num_blocks) (a negative i32, a u32 past the cache) reads page 0, so a bad
    // table gives unspecified values in the affected rows, never an access outside the cache.
    // j < sk <= seqlen_k <= max_blocks * page_block_size keeps the table read inside its row.
    __device__ __forceinline__ int64_t key_offset(const CfFwdParams& p, int j, int64_t page_stride,
                                                  int64_t row_stride) const {
        if (p.block_table == nullptr) return int64_t(j) * row_stride;
        int64_t page;
        int row;
        key_page(p, j, page, row);
        return page * page_stride + int64_t(row) * row_stride;
    }
    // Paged: the page (table entry, clamped as above) and the row within it of key j.
    __device__ __forceinline__ void key_page(const CfFwdParams& p, int j, int64_t& page, int& row) const {
        const uint32_t slot = static_cast<uint32_t>(j) / static_cast<uint32_t>(p.page_block_size);
        const uint32_t entry = static_cast<uint32_t>(p.block_table[int64_t(b) * p.block_table_batch_stride + slot]);
        page = entry < static_cast<uint32_t>(p.num_blocks) ? entry : 0;
        row = j - int(slot) * p.page_block_size;
    }

    // cp.async of keys [n0, n0 + ROWS) of one K or V head (`head` = its row 0, from k() / v())
    // into shared memory with Loader (TileLoader / PanelLoader); rows >= sk are zero-filled.
    // Contiguous rows, or a tile inside one page (page_block_size a multiple of ROWS; tiles
    // start at multiples of ROWS): one address per tile, so one table lookup. Otherwise (small
    // or odd pages) each row is looked up.
    template <class Loader, int ROWS, typename T>
    __device__ __forceinline__ void load_keys(const CfFwdParams& p, T* s, const T* head, int64_t page_stride,
                                              int64_t row_stride, int n0, int dch, int tid,
                                              const void* fallback) const {
        if (p.block_table == nullptr || p.page_block_size % ROWS == 0) {
            Loader::template load<ROWS>(s, head + key_offset(p, n0, page_stride, row_stride), row_stride, sk - n0,
                                        dch, tid, fallback);
        } else {
            Loader::template gather<ROWS>(
                s, [&](int r) { return head + key_offset(p, n0 + r, page_stride, row_stride); }, sk - n0, dch, tid,
                fallback);
        }
    }
    // K and V tiles of the same keys [n0, n0 + ROWS) (TileLoader only): as two load_keys, but
    // row by row one lookup serves both tiles and every row's lookup is in flight at once (the
    // split-KV decode kernel, where small pages would otherwise serialise on the table reads).
    template <class Loader, int ROWS, typename T>
    __device__ __forceinline__ void load_kv(const CfFwdParams& p, T* sK, T* sV, const T* kg, const T* vg, int n0,
                                            int dch, int tid) const {
        if (p.block_table == nullptr || p.page_block_size % ROWS == 0) {
            load_keys<Loader, ROWS>(p, sK, kg, p.k_batch_stride, p.k_row_stride, n0, dch, tid, p.k);
            load_keys<Loader, ROWS>(p, sV, vg, p.v_batch_stride, p.v_row_stride, n0, dch, tid, p.v);
        } else {
            Loader::template gather2<ROWS>(
                sK, sV,
                [&](int r, const T* (&src)[2]) {
                    int64_t page;
                    int row;
                    key_page(p, n0 + r, page, row);
                    src[0] = kg + page * p.k_batch_stride + int64_t(row) * p.k_row_stride;
                    src[1] = vg + page * p.v_batch_stride + int64_t(row) * p.v_row_stride;
                },
                sk - n0, dch, tid, p.k);
        }
    }
    template <class Loader, int ROWS, typename T>
    __device__ __forceinline__ void load_k(const CfFwdParams& p, T* s, const T* kg, int n0, int dch, int tid) const {
        load_keys<Loader, ROWS>(p, s, kg, p.k_batch_stride, p.k_row_stride, n0, dch, tid, p.k);
    }
    template <class Loader, int ROWS, typename T>
    __device__ __forceinline__ void load_v(const CfFwdParams& p, T* s, const T* vg, int n0, int dch, int tid) const {
        load_keys<Loader, ROWS>(p, s, vg, p.v_batch_stride, p.v_row_stride, n0, dch, tid, p.v);
    }

    // Element offset of (row 0 of this sequence, head h) in a q-side / k-side tensor.
    __device__ __forceinline__ int64_t q_off(int64_t batch_stride, int64_t row_stride, int64_t head_stride, int h) const {
        return (q_varlen ? q_row0 * row_stride : int64_t(b) * batch_stride) + int64_t(h) * head_stride;
    }
    __device__ __forceinline__ int64_t k_off(int64_t batch_stride, int64_t row_stride, int64_t head_stride, int h) const {
        return (k_varlen ? k_row0 * row_stride : int64_t(b) * batch_stride) + int64_t(h) * head_stride;
    }

    // Row 0 of head h (query side) / KV head hk (key side) of each tensor.
    template <typename T> __device__ __forceinline__ const T* q(const CfFwdParams& p, int h) const {
        return static_cast<const T*>(p.q) + q_off(p.q_batch_stride, p.q_row_stride, p.q_head_stride, h);
    }
    template <typename T> __device__ __forceinline__ const T* k(const CfFwdParams& p, int hk) const {
        return static_cast<const T*>(p.k) + k_off(p.k_batch_stride, p.k_row_stride, p.k_head_stride, hk);
    }
    template <typename T> __device__ __forceinline__ const T* v(const CfFwdParams& p, int hk) const {
        return static_cast<const T*>(p.v) + k_off(p.v_batch_stride, p.v_row_stride, p.v_head_stride, hk);
    }
    template <typename T> __device__ __forceinline__ T* o(const CfFwdParams& p, int h) const {
        return static_cast<T*>(p.o) + q_off(p.o_batch_stride, p.o_row_stride, p.o_head_stride, h);
    }
    // lse of (this sequence, head h, row 0); rows are contiguous.
    __device__ __forceinline__ float* lse(const CfFwdParams& p, int h) const {
        return p.lse + int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + (q_varlen ? q_row0 : 0);
    }
    template <typename T> __device__ __forceinline__ const T* dout(const CfBwdParams& p, int h) const {
        return static_cast<const T*>(p.dout) + q_off(p.do_batch_stride, p.do_row_stride, p.do_head_stride, h);
    }
    template <typename T> __device__ __forceinline__ T* dq(const CfBwdParams& p, int h) const {
        return static_cast<T*>(p.dq) + q_off(p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, h);
    }
    template <typename T> __device__ __forceinline__ T* dk(const CfBwdParams& p, int hk) const {
        return static_cast<T*>(p.dk) + k_off(p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, hk);
    }
    template <typename T> __device__ __forceinline__ T* dv(const CfBwdParams& p, int hk) const {
        return static_cast<T*>(p.dv) + k_off(p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, hk);
    }
};

// Head dim of v, o, dout and dv (flash_api.h: dv == 0 means d).
__host__ __device__ inline int head_dim_v(const CfFwdParams& p) { return p.dv > 0 ? p.dv : p.d; }

// Whether v is k's own storage, the first dv columns of each of its rows (MLA: the value is a
// view of the compressed latent that is also the key). The kernels then load each key row once.
__host__ __device__ inline bool v_is_view_of_k(const CfFwdParams& p) {
    return p.v == p.k && head_dim_v(p) <= p.d && p.v_batch_stride == p.k_batch_stride &&
           p.v_row_stride == p.k_row_stride && p.v_head_stride == p.k_head_stride;
}

// KV head read by query head h (GQA / MQA: h / group).
__device__ __forceinline__ int kv_head(const CfFwdParams& p, int h) { return h / (p.h / p.hkv); }

}  // namespace cf
