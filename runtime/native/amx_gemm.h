/* The AMX tile machinery the bf16 GEMM kernels share (expert_amx.c: a routed expert's MLP;
 * linear_amx.c: a dense projection): rows as tiles (packed_at, pack_row), oneDNN's packed weight
 * tiles (tile_at), the paced prefetch of a weight stream (Pf), a slice's pending epilogue (Epi)
 * and the tile loop over a slice of 32 outputs for every row tile (slice_tiles), over a run of the
 * weight's units (units_tiles); the rows split between threads (chunk_rows, take_chunk). Include after
 * amx.h, inside HAVE_AMX. Header-only, all static.
 *
 * Legend: K inputs, nb the packed weight's output block (32 or 64), MT row tiles of 16, KB = K / 32
 * input steps. */
#ifndef MOECC_AMX_GEMM_H
#define MOECC_AMX_GEMM_H

#include <stdint.h>
#include <string.h>

/* Rows of each chunk where `n` rows (more than a run of max_rows) are split between `nth`
 * threads: chunks of about equal size, a multiple of the threads in number, none past max_rows.
 * Each thread takes whole chunks and runs them alone, in its own max_rows of the scratch (so
 * their callers size it nth * max_rows: amx_gemm.py's scratch_rows). */
static inline int64_t chunk_rows(int64_t n, int nth, int64_t max_rows) {
    const int64_t chunks = (n + max_rows * nth - 1) / (max_rows * nth) * nth;
    return (n + chunks - 1) / chunks;
}

/* The next chunk of a rows split (chunk_rows' `rows` each, `n` rows in all), for whichever thread
 * asks: its first row *r0 and its rows *cn; 0 when every chunk is taken. */
static inline int take_chunk(int64_t *next, int64_t rows, int64_t n, int64_t *r0, int64_t *cn) {
    *r0 = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) * rows;
    if (*r0 >= n) return 0;
    *cn = n - *r0 < rows ? n - *r0 : rows;
    return 1;
}

#ifdef HAVE_AMX
/* Element offset of (row r, column c) in a [rows, K] matrix stored as tiles (packed_at's
 * layout: [r / 16][c / 32][r % 16][c % 32], each A tile one contiguous kilobyte). */
static inline int64_t packed_at(int64_t r, int64_t c, int64_t K) {
    return ((r / 16) * (K / 32) + c / 32) * 512 + (r % 16) * 32 + c % 32;
}

/* Row r of a [rows, K] matrix as tiles (packed_at): src's K elements (NULL: a zero row), each
 * 64-byte piece a tile row apart. */
static inline void pack_row(uint16_t *a, int64_t r, int64_t K, const uint16_t *src) {
    uint16_t *dst = a + packed_at(r, 0, K);
    for (int64_t c = 0; c < K; c += 32, dst += 512)
        if (src) memcpy(dst, src + c, 64);
        else memset(dst, 0, 64);
}

/* Element offset of the tile (outputs o0..o0+15, inputs 32*kb..) in a weight packed AB16b{nb}a2b
 * of K inputs; its rows are nb*2 elements apart, and each block of nb outputs is one run of
 * K*nb elements. */
static inline int64_t tile_at(int64_t o0, int64_t kb, int64_t K, int nb) {
    return ((o0 / nb) * (K / 16) + kb * 2) * 16 * nb + (o0 % nb) * 2;
}

/* Paced prefetch of the next unit's weight blocks (up to two contiguous runs of lines), asked
 * for `per` lines at each K step so the line fill buffers never fill. */
typedef struct { const char *p[2]; int64_t left[2], per; } Pf;

static inline void pf_step(Pf *f) {
    int64_t q = f->per;
    for (int i = 0; i < 2 && q > 0; i++)
        for (; q > 0 && f->left[i] > 0; q--, f->left[i]--, f->p[i] += 64) _mm_prefetch(f->p[i], _MM_HINT_T1);
}

/* The prefetch of blocks r0 and r1 (element offsets; r1 < 0: one run) of `bytes` each over
 * `steps` K steps; nothing when `none`. */
static inline Pf pf_blocks(const uint16_t *w, int64_t r0, int64_t r1, int64_t bytes, int64_t steps, int none) {
    Pf f = {{(const char *)(w + r0), (const char *)(w + (r1 < 0 ? 0 : r1))}, {bytes / 64, r1 < 0 ? 0 : bytes / 64}, 0};
    f.per = (f.left[0] + f.left[1] + steps - 1) / steps;
    if (none) f.left[0] = f.left[1] = 0;
    return f;
}

/* A slice's epilogue (its rows' C to the kernel's output: h, out or y), left pending while the next slice's tiles run
 * and done a few rows at each of that slice's K steps: its AVX-512 work then runs beside the tile
 * products instead of after them. `rows` does rows [r, upto); `per` rows a step. */
typedef struct Epi {
    void (*rows)(struct Epi *e, int64_t upto);
    const void *j;                             /* the kernel's job */
    const float (*c0)[2][256], (*c1)[2][256];  /* gate and up (expert gate_up), else the result in c0 */
    int64_t col, r, n, per;                    /* the slice's first column; next row, rows */
} Epi;

static inline void epi_step(Epi *e) {
    if (e->r < e->n) e->rows(e, e->r + e->per < e->n ? e->r + e->per : e->n);
}

static inline void epi_finish(Epi *e) {
    if (e->r < e->n) e->rows(e, e->n);
}

#ifndef KBLK
#define KBLK 8  /* input steps (of 32) per pass over the row tiles: B's tiles for them stay in L1 */
#endif
#ifndef KBLK_STREAM
#define KBLK_STREAM 16  /* the same where A's tiles are streamed (STREAM_TILES) */
#endif
#ifndef STREAM_TILES
#define STREAM_TILES 13  /* row tiles (of a block) from which A's tiles load with the streaming hint */
#endif

/* cb[m][t] (16 x 16 fp32 each) = A's row tile m x B's column tile t (b0, b1), for every row tile
 * m < MT, over KB steps of 32 inputs: A as tiles (packed_at: a tile a contiguous kilobyte, which
 * loads from L2 at twice the rate of 16 rows of a row-major matrix); B tiles bstep elements apart
 * by step, rows bstride bytes apart. Row tiles two at a time (C in tiles 0-3), the inputs in blocks
 * of kblk steps (the partial sums through cb between blocks), so a block's B tiles are read from
 * memory once and from L1 by the other row tiles. `stream` (a constant: slice_tiles' two builds)
 * loads A's tiles with the streaming hint, so they pass L1 without pushing B's out, and B's
 * blocks can be twice as long (half the partial sums' round trips). */
AMX_TARGET __attribute__((always_inline)) static inline void
slice_tiles_as(const uint16_t *a, int64_t MT, const uint16_t *b0, const uint16_t *b1, int64_t bstep, int64_t bstride,
               int64_t KB, Pf *pf, Epi *epi, float (*cb)[2][256], const int stream) {
    const int64_t kblk = stream ? KBLK_STREAM : KBLK;
    for (int64_t k0 = 0; k0 < KB; k0 += kblk) {
        const int64_t k1 = k0 + kblk < KB ? k0 + kblk : KB;
        for (int64_t m = 0; m < MT; m += 2) {
            const int two = m + 1 < MT;
            if (k0 == 0) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            } else {
                _tile_loadd(0, cb[m][0], 64); _tile_loadd(1, cb[m][1], 64);
                if (two) { _tile_loadd(2, cb[m + 1][0], 64); _tile_loadd(3, cb[m + 1][1], 64); }
            }
            const uint16_t *a0 = a + m * KB * 512;  /* row tile m's first tile */
            for (int64_t kb = k0; kb < k1; kb++) {
                pf_step(pf);
                epi_step(epi);
                if (stream) _tile_stream_loadd(4, a0 + kb * 512, 64);
                else _tile_loadd(4, a0 + kb * 512, 64);
                _tile_loadd(6, b0 + kb * bstep, bstride);
                _tile_loadd(7, b1 + kb * bstep, bstride);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    if (stream) _tile_stream_loadd(5, a0 + (KB + kb) * 512, 64);
                    else _tile_loadd(5, a0 + (KB + kb) * 512, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, cb[m][0], 64); _tile_stored(1, cb[m][1], 64);
            if (two) { _tile_stored(2, cb[m + 1][0], 64); _tile_stored(3, cb[m + 1][1], 64); }
        }
    }
}

#define SLICE_ARGS const uint16_t *a, int64_t MT, const uint16_t *b0, const uint16_t *b1, int64_t bstep, \
                   int64_t bstride, int64_t KB, Pf *pf, Epi *epi, float (*cb)[2][256]
AMX_TARGET static void slice_tiles_l2(SLICE_ARGS) { slice_tiles_as(a, MT, b0, b1, bstep, bstride, KB, pf, epi, cb, 0); }
AMX_TARGET static void slice_tiles_streamed(SLICE_ARGS) {
    slice_tiles_as(a, MT, b0, b1, bstep, bstride, KB, pf, epi, cb, 1);
}

/* slice_tiles_as, A's tiles streamed from STREAM_TILES row tiles on (a prefill step's experts:
 * 1.05-1.13x a layer); below (a decode step's experts, ~128-190 rows) plain loads measured as
 * fast or faster (0.94-0.97x streamed from 9 tiles on at bench 1024's 512 tokens). */
static inline void slice_tiles(SLICE_ARGS) {
    (MT >= STREAM_TILES ? slice_tiles_streamed : slice_tiles_l2)(a, MT, b0, b1, bstep, bstride, KB, pf, epi, cb);
}
#undef SLICE_ARGS

#ifndef ROWS_L2
#define ROWS_L2 (1280 * 1024)  /* bytes of A's row tiles a pass keeps in L2 across its slices */
#endif

/* Row tiles of each block of a pass over MT row tiles of K inputs: as many as ROWS_L2 holds
 * (each slice rereads every row tile of its block; past L2 they come from L3 at a third of the
 * rate: down's 512 rows of 3,584 inputs, 3.5 MB, ran at 0.8 TFLOP/s a core against 1.5 in blocks
 * of 128 rows), the blocks of about equal size; every weight unit then streams once a block. */
static inline int64_t block_tiles(int64_t MT, int64_t K) {
    const int64_t fit = ROWS_L2 / (32 * K) < 2 ? 2 : ROWS_L2 / (32 * K);  /* a row tile: 16 rows of K bf16 */
    const int64_t blocks = (MT + fit - 1) / fit;
    return (MT + blocks - 1) / blocks;
}

/* The prefetch, during unit un of a pass over units [u0, u1) in row blocks (block_tiles), of the
 * unit after it: the next one, or the first again for the next block (none after the last
 * block's last). A unit is a run of `run` elements of w, and where `half` > 0 also the run `half`
 * units on (gate/up's up half); `steps` K steps spread the lines. */
static inline Pf pf_after(const uint16_t *w, int64_t un, int64_t u0, int64_t u1, int64_t t1, int64_t MT, int64_t run,
                          int64_t half, int64_t steps) {
    const int64_t next = un + 1 < u1 ? un + 1 : t1 < MT ? u0 : -1;
    const int64_t r0 = next < 0 ? 0 : next * run;
    return pf_blocks(w, r0, half > 0 ? r0 + half * run : -1, run * 2, steps, next < 0);
}

/* The outputs of units [u0, u1) (nb outputs each, nb/32 slices of 32) of weight w (packed nb, K
 * inputs) for every one of a's MT row tiles, the rows in blocks (block_tiles): each slice through
 * slice_tiles into C buffer c[*b] (*b toggled a slice; row tile m at c[*b][m]), and where `half`
 * > 0 the same slice of the weight's second half (`half` units on: gate/up's up) into c2[*b]
 * after it; the next unit's weights asked for during the unit, and each slice's result (c0, and
 * c1 from c2) handed to e (its block's rows below n, the slice's column) while the next slice's
 * tiles run. The last slice's epilogue is left pending: the caller finishes it (epi_finish) after
 * its last call. */
AMX_TARGET static inline void units_tiles(const uint16_t *a, int64_t MT, const uint16_t *w, int64_t K, int nb,
                                          int64_t half, int64_t u0, int64_t u1, int64_t n, Epi *e,
                                          float (*c[2])[2][256], float (*c2[2])[2][256], int *b) {
    const int64_t KB = K / 32, run = K * nb, bt = block_tiles(MT, K), second = half * nb;  /* second half's output 0 */
    for (int64_t t0 = 0, t1; t0 < MT; t0 = t1) {
        t1 = t0 + bt < MT ? t0 + bt : MT;
        const uint16_t *at = a + t0 * KB * 512;
        const int64_t steps = (half > 0 ? 2 : 1) * (nb / 32) * ((t1 - t0 + 1) / 2) * KB;
        for (int64_t un = u0; un < u1; un++) {
            Pf pf = pf_after(w, un, u0, u1, t1, MT, run, half, steps);
            for (int64_t o = un * nb; o < (un + 1) * nb; o += 32, *b ^= 1) {  /* a slice: outputs o .. o + 31 */
                slice_tiles(at, t1 - t0, w + tile_at(o, 0, K, nb), w + tile_at(o + 16, 0, K, nb), 32 * nb, nb * 4, KB,
                            &pf, e, c[*b] + t0);
                if (half > 0)
                    slice_tiles(at, t1 - t0, w + tile_at(second + o, 0, K, nb), w + tile_at(second + o + 16, 0, K, nb),
                                32 * nb, nb * 4, KB, &pf, e, c2[*b] + t0);
                epi_finish(e);
                e->c0 = (const float (*)[2][256])c[*b], e->c1 = half > 0 ? (const float (*)[2][256])c2[*b] : NULL;
                e->col = o, e->r = 16 * t0, e->n = 16 * t1 < n ? 16 * t1 : n;
            }
        }
    }
}

#endif /* HAVE_AMX */

#endif
