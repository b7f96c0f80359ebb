/* simd.h — the vector layer for the *_simd.c files, each compiled once per
 * vector ISA (AVX2, AVX-512, AVX512-BF16; see KW__VARIANTS in kw_ops_impl.h).
 *
 * One vocabulary over KW_VW f32 lanes, chosen by the flags the file is compiled
 * with, so a kernel body written once builds for AVX2 and AVX-512.
 * Partial loads and stores (the `n` variants, n < KW_VW) never touch memory past
 * n elements. bf16 stores round to nearest even exactly like kw__f32_to_bf16
 * (PyTorch's rounding): with vcvtneps2bf16 (AVX512-BF16) only where no lane
 * holds a denormal, which it flushes, or a NaN. */
#ifndef KW_SIMD_H
#define KW_SIMD_H

#include <immintrin.h>

#include "kw_ops_impl.h"

#if defined(__AVX512BF16__)
#define KW_ISA_SUFFIX avx512bf16
#elif defined(__AVX512F__)
#define KW_ISA_SUFFIX avx512
#elif defined(__AVX2__)
#define KW_ISA_SUFFIX avx2
#else
#error "simd.h is for *_simd.c files, built with AVX2 or AVX-512 flags"
#endif

#define KW__CAT2(a, b) a##_##b
#define KW__CAT(a, b) KW__CAT2(a, b)
/* kw__name_<isa>: the exported name of a kernel defined in a *_body.h. */
#define KW__ISA_NAME(name) KW__CAT(name, KW_ISA_SUFFIX)

#if defined(__AVX512F__)

#define KW_VW 16
typedef __m512 kw_v;

static inline __mmask16 kw__m16(int64_t n) { return (__mmask16)((1u << n) - 1u); }

static inline kw_v kw_v_zero(void) { return _mm512_setzero_ps(); }
static inline kw_v kw_v_set1(float x) { return _mm512_set1_ps(x); }
static inline kw_v kw_v_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline kw_v kw_v_loadn(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(kw__m16(n), p); }
static inline void kw_v_storeu(float *p, kw_v v) { _mm512_storeu_ps(p, v); }
static inline void kw_v_storen(float *p, kw_v v, int64_t n) { _mm512_mask_storeu_ps(p, kw__m16(n), v); }
/* Lanes >= n replaced by `fill` (or by 0). */
static inline kw_v kw_v_fill_tail(kw_v v, int64_t n, float fill) { return _mm512_mask_mov_ps(_mm512_set1_ps(fill), kw__m16(n), v); }
static inline kw_v kw_v_keepn(kw_v v, int64_t n) { return _mm512_maskz_mov_ps(kw__m16(n), v); }
/* Lanes where !(a <= b): a > b, or either is NaN. */
static inline unsigned kw_v_nle_bits(kw_v a, kw_v b) { return (unsigned)_mm512_cmp_ps_mask(a, b, _CMP_NLE_UQ); }

static inline kw_v kw__widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline kw_v kw_v_load_bf16(const uint16_t *p) { return kw__widen_bf16(_mm256_loadu_si256((const __m256i *)p)); }
static inline kw_v kw_v_loadn_bf16(const uint16_t *p, int64_t n) {
    return kw__widen_bf16(_mm256_maskz_loadu_epi16(kw__m16(n), p));
}
static inline __m256i kw__narrow_bf16_exact(kw_v v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}
#if defined(__AVX512BF16__)
/* The lanes vcvtneps2bf16 rounds otherwise than kw__f32_to_bf16 (fpclass
 * categories): denormals, which it flushes to zero, and NaNs, whose sign and
 * payload it keeps where PyTorch writes 0x7fc0. */
#define KW__BF16_CVT_DIFFERS 0xa1
/* One instruction where the exact path takes nine: GELU over ViT-base's MLP
 * at batch 8 (1576 × 3072, bf16) took 1.44-1.46 ms a call against 1.63-1.64,
 * its attention 2.60-2.65 ms against 3.19-3.24 (2-vCPU Xeon). */
static inline __m256i kw__narrow_bf16(kw_v v) {
    if (_mm512_fpclass_ps_mask(v, KW__BF16_CVT_DIFFERS)) return kw__narrow_bf16_exact(v);
    return (__m256i)_mm512_cvtneps_pbh(v);
}
/* lo then hi as 32 bf16, rounded as kw__narrow_bf16 rounds them. */
static inline __m512i kw__narrow2_bf16(kw_v lo, kw_v hi) {
    if (_mm512_fpclass_ps_mask(lo, KW__BF16_CVT_DIFFERS) | _mm512_fpclass_ps_mask(hi, KW__BF16_CVT_DIFFERS))
        return _mm512_inserti64x4(_mm512_castsi256_si512(kw__narrow_bf16_exact(lo)), kw__narrow_bf16_exact(hi), 1);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
#else
static inline __m256i kw__narrow_bf16(kw_v v) { return kw__narrow_bf16_exact(v); }
#endif
static inline void kw_v_store_bf16(uint16_t *p, kw_v v) { _mm256_storeu_si256((__m256i *)p, kw__narrow_bf16(v)); }
static inline void kw_v_storen_bf16(uint16_t *p, kw_v v, int64_t n) {
    _mm256_mask_storeu_epi16(p, kw__m16(n), kw__narrow_bf16(v));
}

/* 2·KW_VW bf16 read as KW_VW pairs: the even elements widened are the low halves
 * shifted up, the odd ones the high halves masked, no shuffle (see linear_body.h). */
typedef __m512i kw_vpair;
static inline kw_vpair kw_vpair_load(const uint16_t *p) { return _mm512_loadu_si512(p); }
static inline kw_vpair kw_vpair_loadn(const uint16_t *p, int64_t n) {
    return _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
}
static inline kw_v kw_vpair_even(kw_vpair v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline kw_v kw_vpair_odd(kw_vpair v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
/* The even and the odd lanes of the 2·KW_VW floats a:b. */
static inline void kw_v_deinterleave(kw_v a, kw_v b, kw_v *even, kw_v *odd) {
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *even = _mm512_permutex2var_ps(a, ie, b);
    *odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(ie, _mm512_set1_epi32(1)), b);
}

static inline kw_v kw_v_add(kw_v a, kw_v b) { return _mm512_add_ps(a, b); }
static inline kw_v kw_v_sub(kw_v a, kw_v b) { return _mm512_sub_ps(a, b); }
static inline kw_v kw_v_mul(kw_v a, kw_v b) { return _mm512_mul_ps(a, b); }
static inline kw_v kw_v_div(kw_v a, kw_v b) { return _mm512_div_ps(a, b); }
static inline kw_v kw__v_rcp_estimate(kw_v a) { return _mm512_rcp14_ps(a); } /* 2^-14 */
static inline kw_v kw_v_fmadd(kw_v a, kw_v b, kw_v c) { return _mm512_fmadd_ps(a, b, c); }
static inline kw_v kw_v_fnmadd(kw_v a, kw_v b, kw_v c) { return _mm512_fnmadd_ps(a, b, c); }
/* max/min return b when either is NaN (the x86 rule); callers order operands for it. */
static inline kw_v kw_v_max(kw_v a, kw_v b) { return _mm512_max_ps(a, b); }
static inline kw_v kw_v_min(kw_v a, kw_v b) { return _mm512_min_ps(a, b); }
static inline kw_v kw_v_abs(kw_v a) { return _mm512_abs_ps(a); }
static inline kw_v kw_v_xor(kw_v a, kw_v b) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b))); }
static inline kw_v kw_v_and(kw_v a, kw_v b) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_castps_si512(b))); }
static inline kw_v kw_v_round(kw_v a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* r where a and b are numbers, a + b (a NaN) where either is NaN. */
static inline kw_v kw_v_nan_or(kw_v a, kw_v b, kw_v r) {
    return _mm512_mask_add_ps(r, _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q), a, b);
}
/* r[i] = Σ v[i] for KW_VW vectors at once: a transpose-and-add tree, about three
 * instructions per sum against a dozen for one kw_v_reduce_add each. */
static inline kw_v kw_v_reduce_add_lanes(const kw_v *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}
/* v[i] lane j <-> v[j] lane i: a KW_VW × KW_VW block transposed in registers. */
static inline void kw_v_transpose(kw_v *v) {
    __m512 a[16], b[16], c[16];
    for (int i = 0; i < 8; i++)
        a[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), a[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < 4; i++) /* b[4i + e], 128-bit lane l: column 4l + e of rows 4i .. 4i + 3 */
        for (int h = 0; h < 2; h++) {
            const __m512d x = _mm512_castps_pd(a[4 * i + h]), y = _mm512_castps_pd(a[4 * i + 2 + h]);
            b[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
            b[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
        }
    for (int e = 0; e < 4; e++) {
        c[e] = _mm512_shuffle_f32x4(b[e], b[4 + e], 0x88), c[4 + e] = _mm512_shuffle_f32x4(b[e], b[4 + e], 0xdd);
        c[8 + e] = _mm512_shuffle_f32x4(b[8 + e], b[12 + e], 0x88);
        c[12 + e] = _mm512_shuffle_f32x4(b[8 + e], b[12 + e], 0xdd);
    }
    for (int e = 0; e < 4; e++) {
        v[e] = _mm512_shuffle_f32x4(c[e], c[8 + e], 0x88), v[8 + e] = _mm512_shuffle_f32x4(c[e], c[8 + e], 0xdd);
        v[4 + e] = _mm512_shuffle_f32x4(c[4 + e], c[12 + e], 0x88);
        v[12 + e] = _mm512_shuffle_f32x4(c[4 + e], c[12 + e], 0xdd);
    }
}
/* Lane i: on where bit i of bits is set, off elsewhere. */
static inline kw_v kw_v_blend_bits(unsigned bits, kw_v on, kw_v off) {
    return _mm512_mask_blend_ps((__mmask16)bits, off, on);
}
static inline kw_v kw_v_swap_pairs(kw_v a) { return _mm512_permute_ps(a, 0xb1); } /* lanes 2i <-> 2i+1 */
static inline kw_v kw_v_signs_even(void) { return _mm512_castsi512_ps(_mm512_set1_epi64(0x80000000)); }
static inline float kw_v_reduce_add(kw_v a) { return _mm512_reduce_add_ps(a); }
static inline float kw_v_reduce_max(kw_v a) { return _mm512_reduce_max_ps(a); }
/* a * 2^n for an integral-valued n, with IEEE overflow and gradual underflow. */
static inline kw_v kw__v_ldexp(kw_v a, kw_v n) { return _mm512_scalef_ps(a, n); }

#else /* AVX2 + FMA */

#define KW_VW 8
typedef __m256 kw_v;

static inline __m256i kw__m8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline kw_v kw_v_zero(void) { return _mm256_setzero_ps(); }
static inline kw_v kw_v_set1(float x) { return _mm256_set1_ps(x); }
static inline kw_v kw_v_loadu(const float *p) { return _mm256_loadu_ps(p); }
static inline kw_v kw_v_loadn(const float *p, int64_t n) { return _mm256_maskload_ps(p, kw__m8(n)); }
static inline void kw_v_storeu(float *p, kw_v v) { _mm256_storeu_ps(p, v); }
static inline void kw_v_storen(float *p, kw_v v, int64_t n) { _mm256_maskstore_ps(p, kw__m8(n), v); }
static inline kw_v kw_v_fill_tail(kw_v v, int64_t n, float fill) {
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(kw__m8(n)));
}
static inline kw_v kw_v_keepn(kw_v v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(kw__m8(n))); }
static inline unsigned kw_v_nle_bits(kw_v a, kw_v b) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_NLE_UQ)); }

static inline kw_v kw__widen_bf16(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline kw_v kw_v_load_bf16(const uint16_t *p) { return kw__widen_bf16(_mm_loadu_si128((const __m128i *)p)); }
/* AVX2 has no 16-bit masked load: the first n through a copy on the stack, a
 * whole vector (n >= 8) loaded as one. Callers pass whole vectors too (the
 * attention's blocks load every row of a cache head this way): with every load
 * through the copy, ops_bench --attention on a Zen 3 EPYC took 7.05-7.30 ms
 * for SmolLM2-360M's bf16 step of 128 positions over 512 (float32 2.71-2.80),
 * 3.26 with whole vectors loaded as one; ViT-base's at batch 8 31.1 → 16.9. */
static inline kw_v kw_v_loadn_bf16(const uint16_t *p, int64_t n) {
    if (n >= 8) return kw_v_load_bf16(p);
    uint16_t tmp[8] = {0};
    memcpy(tmp, p, (size_t)n * 2);
    return kw_v_load_bf16(tmp);
}
static inline __m128i kw__narrow_bf16(kw_v v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline void kw_v_store_bf16(uint16_t *p, kw_v v) { _mm_storeu_si128((__m128i *)p, kw__narrow_bf16(v)); }
static inline void kw_v_storen_bf16(uint16_t *p, kw_v v, int64_t n) {
    if (n >= 8) {
        kw_v_store_bf16(p, v);
        return;
    }
    uint16_t tmp[8];
    _mm_storeu_si128((__m128i *)tmp, kw__narrow_bf16(v));
    memcpy(p, tmp, (size_t)n * 2);
}

typedef __m256i kw_vpair;
static inline kw_vpair kw_vpair_load(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline kw_vpair kw_vpair_loadn(const uint16_t *p, int64_t n) {
    uint16_t tmp[16] = {0};
    memcpy(tmp, p, (size_t)n * 2);
    return kw_vpair_load(tmp);
}
static inline kw_v kw_vpair_even(kw_vpair v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline kw_v kw_vpair_odd(kw_vpair v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline void kw_v_deinterleave(kw_v a, kw_v b, kw_v *even, kw_v *odd) {
    /* within 128-bit lanes, then the 64-bit quarters in order 0, 2, 1, 3 */
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
}

static inline kw_v kw_v_add(kw_v a, kw_v b) { return _mm256_add_ps(a, b); }
static inline kw_v kw_v_sub(kw_v a, kw_v b) { return _mm256_sub_ps(a, b); }
static inline kw_v kw_v_mul(kw_v a, kw_v b) { return _mm256_mul_ps(a, b); }
static inline kw_v kw_v_div(kw_v a, kw_v b) { return _mm256_div_ps(a, b); }
static inline kw_v kw__v_rcp_estimate(kw_v a) { return _mm256_rcp_ps(a); } /* 1.5 · 2^-12 */
static inline kw_v kw_v_fmadd(kw_v a, kw_v b, kw_v c) { return _mm256_fmadd_ps(a, b, c); }
static inline kw_v kw_v_fnmadd(kw_v a, kw_v b, kw_v c) { return _mm256_fnmadd_ps(a, b, c); }
static inline kw_v kw_v_max(kw_v a, kw_v b) { return _mm256_max_ps(a, b); }
static inline kw_v kw_v_min(kw_v a, kw_v b) { return _mm256_min_ps(a, b); }
static inline kw_v kw_v_xor(kw_v a, kw_v b) { return _mm256_xor_ps(a, b); }
static inline kw_v kw_v_and(kw_v a, kw_v b) { return _mm256_and_ps(a, b); }
static inline kw_v kw_v_abs(kw_v a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline kw_v kw_v_round(kw_v a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline kw_v kw_v_nan_or(kw_v a, kw_v b, kw_v r) {
    return _mm256_blendv_ps(r, _mm256_add_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}
static inline kw_v kw_v_reduce_add_lanes(const kw_v *v) {
    __m256 a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
        b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
static inline void kw_v_transpose(kw_v *v) {
    __m256 a[8], b[8];
    for (int i = 0; i < 4; i++)
        a[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), a[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < 2; i++) /* b[4i + e], 128-bit lane l: column 4l + e of rows 4i .. 4i + 3 */
        for (int h = 0; h < 2; h++) {
            const __m256d x = _mm256_castps_pd(a[4 * i + h]), y = _mm256_castps_pd(a[4 * i + 2 + h]);
            b[4 * i + 2 * h] = _mm256_castpd_ps(_mm256_unpacklo_pd(x, y));
            b[4 * i + 2 * h + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(x, y));
        }
    for (int e = 0; e < 4; e++)
        v[e] = _mm256_permute2f128_ps(b[e], b[4 + e], 0x20), v[4 + e] = _mm256_permute2f128_ps(b[e], b[4 + e], 0x31);
}
static inline kw_v kw_v_blend_bits(unsigned bits, kw_v on, kw_v off) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), lane), lane);
    return _mm256_blendv_ps(off, on, _mm256_castsi256_ps(set));
}
static inline kw_v kw_v_swap_pairs(kw_v a) { return _mm256_permute_ps(a, 0xb1); }
static inline kw_v kw_v_signs_even(void) { return _mm256_castsi256_ps(_mm256_set1_epi64x(0x80000000)); }
static inline float kw_v_reduce_add(kw_v a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float kw_v_reduce_max(kw_v a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* a * 2^n in two steps so that n in [-150, 129] never leaves the exponent range
 * of either factor: the result overflows or underflows (gradually) only once. */
static inline kw_v kw__v_ldexp(kw_v a, kw_v n) {
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const kw_v p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const kw_v p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(a, p1), p2);
}

#endif

/* ---- dtype-generic access (F32 or BF16), for bodies that take either ---- */

static inline kw_v kw_v_ld(const void *p, int64_t i, kw_dtype dt) {
    return dt == KW_BF16 ? kw_v_load_bf16((const uint16_t *)p + i) : kw_v_loadu((const float *)p + i);
}
static inline kw_v kw_v_ldn(const void *p, int64_t i, int64_t n, kw_dtype dt) {
    return dt == KW_BF16 ? kw_v_loadn_bf16((const uint16_t *)p + i, n) : kw_v_loadn((const float *)p + i, n);
}
static inline void kw_v_st(void *p, int64_t i, kw_dtype dt, kw_v v) {
    if (dt == KW_BF16)
        kw_v_store_bf16((uint16_t *)p + i, v);
    else
        kw_v_storeu((float *)p + i, v);
}
static inline void kw_v_stn(void *p, int64_t i, int64_t n, kw_dtype dt, kw_v v) {
    if (dt == KW_BF16)
        kw_v_storen_bf16((uint16_t *)p + i, v, n);
    else
        kw_v_storen((float *)p + i, v, n);
}

/* What storing to dtype dt and loading back gives (eager bf16's rounding steps). */
static inline kw_v kw_v_round_to(kw_v v, kw_dtype dt) {
    return dt == KW_BF16 ? kw__widen_bf16(kw__narrow_bf16(v)) : v;
}

/* ---- transcendental functions ---- */

/* e^x for x in [-87.3, 88.8], NaN passing through: 2^n · e^r with n = round(x / ln 2)
 * and r = x - n ln 2 (Cephes' expf polynomial, about 1 ulp). */
static inline kw_v kw__v_exp_in_range(kw_v x) {
    const kw_v n = kw_v_round(kw_v_mul(x, kw_v_set1(1.44269504088896341f)));
    kw_v r = kw_v_fnmadd(n, kw_v_set1(0.693359375f), x);
    r = kw_v_fnmadd(n, kw_v_set1(-2.12194440e-4f), r);
    kw_v p = kw_v_set1(1.9875691500e-4f);
    p = kw_v_fmadd(p, r, kw_v_set1(1.3981999507e-3f));
    p = kw_v_fmadd(p, r, kw_v_set1(8.3334519073e-3f));
    p = kw_v_fmadd(p, r, kw_v_set1(4.1665795894e-2f));
    p = kw_v_fmadd(p, r, kw_v_set1(1.6666665459e-1f));
    p = kw_v_fmadd(p, r, kw_v_set1(5.0000001201e-1f));
    p = kw_v_fmadd(kw_v_mul(p, r), r, kw_v_add(r, kw_v_set1(1.0f)));
    return kw__v_ldexp(p, n);
}

/* expf to about 1 ulp (Cephes' polynomial): NaN stays NaN, -inf gives 0, +inf
 * gives inf. Results below FLT_MIN (x under ln FLT_MIN) are zero, not denormal:
 * an Intel core takes a microcode assist for each instruction that makes a
 * denormal, and a softmax's masked or padded positions make one in every
 * vector that holds them (ViT-base's attention at batch 8, 197 positions padded
 * to 208, spent 58 % of its time in the softmax's exp). Every use here adds
 * the result to 1 or more (a softmax's sum holds its largest term, exp(0) = 1;
 * silu, erf, tanh), where 1.2e-38 is lost anyway. */
static inline kw_v kw_v_exp(kw_v x) {
    const unsigned normal = kw_v_nle_bits(x, kw_v_set1(-87.3365f)); /* NaN too */
    x = kw_v_min(kw_v_set1(88.8f), kw_v_max(kw_v_set1(-87.3365f), x)); /* NaN passes through */
    return kw_v_blend_bits(normal, kw__v_exp_in_range(x), kw_v_zero());
}

/* GELU, x·Φ(x) = 0.5·x·(1 + erf(x / √2)), with ATen's erf (Abramowitz & Stegun
 * 7.1.26, absolute error below 1.5e-7): erf(a) = 1 - w for a >= 0, w = t·P(t)·e^(-a²),
 * t = 1 / (1 + p·a). So GELU is relu(x) - 0.5·|x|·w on both sides of 0, with no
 * sign to take off and put back, and e^(-x²/2) needs no test for underflow when
 * clamped at -80: GELU is under 1e-35 in magnitude there either way, and e stays
 * normal (a denormal costs a microcode assist). ViT-base's MLP at batch 8 (1576 ×
 * 3072) on a 2-vCPU Xeon: 1.20 ms a call in bf16 and 1.09 in f32, against 1.44
 * and 1.49 with erf taken alone and PyTorch's (oneDNN's) 0.96 and 0.90. ±inf
 * give NaN, as PyTorch's. */
static inline kw_v kw_v_gelu_erf(kw_v x) {
    const kw_v ax = kw_v_abs(x), hx = kw_v_mul(ax, kw_v_set1(0.5f)), one = kw_v_set1(1.0f);
    const kw_v d = kw_v_fmadd(kw_v_set1(0.3275911f * 0.70710678118654752f), ax, one), t0 = kw__v_rcp_estimate(d);
    const kw_v t = kw_v_fmadd(t0, kw_v_fnmadd(d, t0, one), t0); /* 1 / d, one Newton step */
    kw_v r = kw_v_fmadd(kw_v_set1(1.061405429f), t, kw_v_set1(-1.453152027f));
    r = kw_v_fmadd(r, t, kw_v_set1(1.421413741f));
    r = kw_v_fmadd(r, t, kw_v_set1(-0.284496736f));
    r = kw_v_fmadd(r, t, kw_v_set1(0.254829592f));
    const kw_v e = kw__v_exp_in_range(kw_v_max(kw_v_set1(-80.0f), kw_v_fnmadd(hx, ax, kw_v_zero())));
    const kw_v w = kw_v_mul(kw_v_mul(t, r), e);
    return kw_v_fnmadd(hx, w, kw_v_max(kw_v_zero(), x)); /* NaN: through hx */
}

#endif
