/* One CPU tensor's sum, sum of squares and largest magnitude, read in place, summed in numpy's order.
 *
 * The statistics recorder's numpy path (replaydiff/record/stats.py) defines the numbers; this file computes the
 * same ones bit for bit without copying the values first:
 *   - fewer than `chunk` values (values_stats' batch: np.add.reduceat over one segment): the first value plus
 *     numpy's pairwise sum of the rest;
 *   - `chunk` values or more (_large_stats): per chunk of `chunk` values, 0.0 plus the pairwise sum of the chunk
 *     (ndarray.sum), the chunks' sums added in order from 0.0 (Python floats).
 * numpy's pairwise sum (pairwise_sum in numpy/_core/src/umath/loops_utils.h.src): under 8 values, added in order
 * from -0.0; up to 128, eight accumulators seeded with the first eight values, combined as
 * ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the remainder in order; above 128, split at n/2 rounded down to a
 * multiple of 8 and the halves' sums added. Squares are rounded to double before they are added: build with
 * -ffp-contract=off (no fused multiply-add) and without -ffast-math.
 *
 * Values are read in numpy's order: a dense tensor as its flat memory range, any other view in row-major order of
 * its shape. No allocation, no Python, no torch: plain C loaded with ctypes. */
#include <stdint.h>
#include <string.h>
#include <math.h>

enum { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

#define BLOCK 128
#define MAXDIM 64

typedef struct {
    const char *base;
    int dtype, ndim;
    int64_t itemsize;
    const int64_t *shape, *strides; /* strides in elements; NULL shape: a dense flat range */
    int64_t pos;                    /* flat position (dense) */
    int64_t idx[MAXDIM];            /* row-major index (strided) */
    int64_t off;                    /* element offset of idx */
} reader;

static double half_to_double(uint16_t h) {
    uint64_t sign = (uint64_t)(h >> 15) << 63;
    int e = (h >> 10) & 0x1f;
    uint64_t m = h & 0x3ff, bits;
    double d;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact */
        d = ldexp((double)m, -24);
        return sign ? -d : d;
    }
    if (e == 31)
        bits = sign | (0x7ffULL << 52) | (m << 42);
    else
        bits = sign | ((uint64_t)(e - 15 + 1023) << 52) | (m << 42);
    memcpy(&d, &bits, 8);
    return d;
}

static inline double value_at(const char *p, int dtype) {
    switch (dtype) {
    case F64: { double v; memcpy(&v, p, 8); return v; }
    case F32: { float v; memcpy(&v, p, 4); return (double)v; }
    case F16: { uint16_t v; memcpy(&v, p, 2); return half_to_double(v); }
    case BF16: { uint16_t v; uint32_t b; float f; memcpy(&v, p, 2); b = (uint32_t)v << 16; memcpy(&f, &b, 4);
                 return (double)f; }
    case I64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case I32: { int32_t v; memcpy(&v, p, 4); return (double)v; }
    case I16: { int16_t v; memcpy(&v, p, 2); return (double)v; }
    case I8: return (double)*(const int8_t *)p;
    case U8: return (double)*(const uint8_t *)p;
    default: return *(const uint8_t *)p != 0 ? 1.0 : 0.0;
    }
}

/* k values as doubles from p, step bytes apart. */
static void convert(const char *p, int64_t step, int dtype, double *out, int64_t k) {
    int64_t i;
    if (step == 4 && dtype == F32) { /* the common cases as tight loops */
        for (i = 0; i < k; i++) { float v; memcpy(&v, p + 4 * i, 4); out[i] = v; }
    } else if (step == 8 && dtype == F64) {
        memcpy(out, p, (size_t)k * 8);
    } else if (step == 2 && dtype == BF16) {
        for (i = 0; i < k; i++) { uint16_t v; uint32_t b; float f; memcpy(&v, p + 2 * i, 2);
            b = (uint32_t)v << 16; memcpy(&f, &b, 4); out[i] = f; }
    } else if (step == 8 && dtype == I64) {
        for (i = 0; i < k; i++) { int64_t v; memcpy(&v, p + 8 * i, 8); out[i] = (double)v; }
    } else {
        for (i = 0; i < k; i++) out[i] = value_at(p + i * step, dtype);
    }
}

/* The next k values as doubles. */
static void read_values(reader *r, double *out, int64_t k) {
    if (r->shape == NULL) {
        convert(r->base + r->pos * r->itemsize, r->itemsize, r->dtype, out, k);
        r->pos += k;
        return;
    }
    while (k > 0) { /* along the last dimension, then the row-major odometer over the others */
        int d = r->ndim - 1;
        int64_t m = r->shape[d] - r->idx[d], step = r->strides[d] * r->itemsize;
        const char *p = r->base + r->off * r->itemsize;
        if (m > k)
            m = k;
        convert(p, step, r->dtype, out, m);
        out += m;
        k -= m;
        r->off += m * r->strides[d];
        r->idx[d] += m;
        while (d >= 0 && r->idx[d] == r->shape[d]) {
            r->off -= r->strides[d] * r->shape[d];
            r->idx[d] = 0;
            if (--d >= 0) {
                r->off += r->strides[d];
                r->idx[d]++;
            }
        }
    }
}

typedef struct { double s, ss, amax; } sums;

/* The eight accumulators of a block of 8 <= n <= 128 values: rs[j] and rq[j] sum x[j], x[j+8], ... and their
 * squares, am[j] their largest magnitude; i = n - n % 8 values are taken. Lane for lane the same additions as the
 * scalar loop, so the vector versions give the same bits. */
#if defined(__SSE2__) && !defined(REPLAYDIFF_SCALAR)
#include <emmintrin.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(REPLAYDIFF_NO_AVX)
#include <immintrin.h>
#define HAVE_AVX 1
/* Four values as doubles, from doubles or (f32) from float32s: the only difference between the two AVX paths. */
__attribute__((target("avx")))
static inline __m256d load4(const char *p, int64_t i, int f32) {
    return f32 ? _mm256_cvtps_pd(_mm_loadu_ps((const float *)(p + 4 * i)))
               : _mm256_loadu_pd((const double *)(p + 8 * i));
}
/* The same with four lanes where the processor has AVX (chosen when the kernel runs: no -march at build); f32: read
 * float32 values straight from memory (the common case), with no pass through a buffer of doubles. */
__attribute__((target("avx")))
static void accumulate_avx(const char *p, int64_t n, int f32, double *rs, double *rq, double *am) {
    const __m256d sign = _mm256_set1_pd(-0.0);
    __m256d s0 = load4(p, 0, f32), s1 = load4(p, 4, f32);
    __m256d q0 = _mm256_mul_pd(s0, s0), q1 = _mm256_mul_pd(s1, s1);
    __m256d a0 = _mm256_andnot_pd(sign, s0), a1 = _mm256_andnot_pd(sign, s1);
    int64_t i;
    for (i = 8; i < n - (n % 8); i += 8) {
        __m256d v0 = load4(p, i, f32), v1 = load4(p, i + 4, f32);
        s0 = _mm256_add_pd(s0, v0);
        s1 = _mm256_add_pd(s1, v1);
        q0 = _mm256_add_pd(q0, _mm256_mul_pd(v0, v0));
        q1 = _mm256_add_pd(q1, _mm256_mul_pd(v1, v1));
        a0 = _mm256_max_pd(_mm256_andnot_pd(sign, v0), a0);
        a1 = _mm256_max_pd(_mm256_andnot_pd(sign, v1), a1);
    }
    _mm256_storeu_pd(rs, s0);
    _mm256_storeu_pd(rs + 4, s1);
    _mm256_storeu_pd(rq, q0);
    _mm256_storeu_pd(rq + 4, q1);
    _mm256_storeu_pd(am, a0);
    _mm256_storeu_pd(am + 4, a1);
}
static int use_avx = -1;
#endif
static void accumulate(const double *x, int64_t n, double *rs, double *rq, double *am) {
    const __m128d sign = _mm_set1_pd(-0.0);
    __m128d s[4], q[4], a[4];
    int64_t i;
    int j;
#ifdef HAVE_AVX
    if (use_avx) {
        accumulate_avx((const char *)x, n, 0, rs, rq, am);
        return;
    }
#endif
    for (j = 0; j < 4; j++) {
        s[j] = _mm_loadu_pd(x + 2 * j);
        q[j] = _mm_mul_pd(s[j], s[j]);
        a[j] = _mm_andnot_pd(sign, s[j]);
    }
    for (i = 8; i < n - (n % 8); i += 8)
        for (j = 0; j < 4; j++) {
            __m128d v = _mm_loadu_pd(x + i + 2 * j);
            s[j] = _mm_add_pd(s[j], v);
            q[j] = _mm_add_pd(q[j], _mm_mul_pd(v, v));
            a[j] = _mm_max_pd(_mm_andnot_pd(sign, v), a[j]); /* (|v| > a) ? |v| : a, as below */
        }
    for (j = 0; j < 4; j++) {
        _mm_storeu_pd(rs + 2 * j, s[j]);
        _mm_storeu_pd(rq + 2 * j, q[j]);
        _mm_storeu_pd(am + 2 * j, a[j]);
    }
}
#else
static void accumulate(const double *x, int64_t n, double *rs, double *rq, double *am) {
    int64_t i;
    int j;
    for (j = 0; j < 8; j++) {
        rs[j] = x[j];
        rq[j] = x[j] * x[j];
        am[j] = fabs(x[j]);
    }
    for (i = 8; i < n - (n % 8); i += 8)
        for (j = 0; j < 8; j++) {
            double v = x[i + j], m = fabs(v);
            rs[j] += v;
            rq[j] += v * v;
            am[j] = m > am[j] ? m : am[j];
        }
}
#endif

/* numpy's combination of the eight accumulators, then the remainder x[n - n % 8 .. n) in order. */
static void combine(const double *x, int64_t n, const double *rs, const double *rq, const double *am, sums *out) {
    double s = ((rs[0] + rs[1]) + (rs[2] + rs[3])) + ((rs[4] + rs[5]) + (rs[6] + rs[7]));
    double ss = ((rq[0] + rq[1]) + (rq[2] + rq[3])) + ((rq[4] + rq[5]) + (rq[6] + rq[7]));
    double a = am[0];
    int64_t i;
    int j;
    for (j = 1; j < 8; j++)
        a = am[j] > a ? am[j] : a;
    for (i = n - (n % 8); i < n; i++) {
        double m = fabs(x[i]);
        s += x[i];
        ss += x[i] * x[i];
        a = m > a ? m : a;
    }
    out->s = s;
    out->ss = ss;
    out->amax = a;
}

/* numpy's pairwise sum of the next n values and of their squares (see the top of this file). */
static void pairwise(reader *r, int64_t n, sums *out) {
    double x[BLOCK];
    int64_t i;
    if (n > BLOCK) {
        int64_t n2 = n / 2;
        sums a, b;
        n2 -= n2 % 8;
        pairwise(r, n2, &a);
        pairwise(r, n - n2, &b);
        out->s = a.s + b.s;
        out->ss = a.ss + b.ss;
        out->amax = a.amax > b.amax ? a.amax : b.amax;
        return;
    }
#ifdef HAVE_AVX
    if (n >= 8 && use_avx && r->shape == NULL && r->dtype == F32) {
        const char *p = r->base + r->pos * 4;
        int64_t tail = n - n % 8;
        double rs[8], rq[8], am[8];
        accumulate_avx(p, n, 1, rs, rq, am);
        convert(p + 4 * tail, 4, F32, x + tail, n - tail); /* the remainder, added below */
        r->pos += n;
        combine(x, n, rs, rq, am, out);
        return;
    }
#endif
    read_values(r, x, n);
    if (n < 8) {
        double s = -0.0, ss = -0.0, am = 0.0;
        for (i = 0; i < n; i++) {
            double m = fabs(x[i]);
            s += x[i];
            ss += x[i] * x[i];
            am = m > am ? m : am;
        }
        out->s = s;
        out->ss = ss;
        out->amax = am;
        return;
    }
    {
        double rs[8], rq[8], am[8];
        accumulate(x, n, rs, rq, am);
        combine(x, n, rs, rq, am, out);
    }
}

/* out = {sum, sum of squares, max |x|} of n values of dtype at data; shape/strides (elements, ndim of them) for a
 * view that is not one dense range, NULL otherwise. Returns 0; 1 where a sum or the maximum is not finite (NaN or
 * Inf inside, or squares that overflow: the caller's numpy path measures the finite values); -1 for what it cannot
 * read. */
int replaydiff_stats(const void *data, int dtype, int64_t n, int ndim, const int64_t *shape, const int64_t *strides,
                     int64_t chunk, double *out) {
    static const int64_t sizes[] = {8, 4, 2, 2, 8, 4, 2, 1, 1, 1};
    reader r;
    sums t;
    double first;
    if (dtype < F64 || dtype > BOOL || n <= 0 || chunk < 1 || ndim > MAXDIM || (shape != NULL && ndim < 1))
        return -1;
#ifdef HAVE_AVX
    if (use_avx < 0) {
        __builtin_cpu_init();
        use_avx = __builtin_cpu_supports("avx") != 0;
    }
#endif
    memset(&r, 0, sizeof r);
    r.base = (const char *)data;
    r.dtype = dtype;
    r.itemsize = sizes[dtype];
    r.shape = shape;
    r.strides = strides;
    r.ndim = ndim;
    if (n < chunk) { /* np.add.reduceat over one segment: its first value, then the pairwise sum of the rest */
        read_values(&r, &first, 1);
        out[0] = first;
        out[1] = first * first;
        out[2] = fabs(first);
        if (n > 1) {
            pairwise(&r, n - 1, &t);
            out[0] += t.s;
            out[1] += t.ss;
            if (t.amax > out[2])
                out[2] = t.amax;
        }
        return isfinite(out[0]) && isfinite(out[1]) && isfinite(out[2]) ? 0 : 1;
    }
    out[0] = out[1] = out[2] = 0.0;
    for (int64_t done = 0; done < n; done += chunk) { /* per chunk: 0.0 + its pairwise sum (ndarray.sum) */
        int64_t k = n - done < chunk ? n - done : chunk;
        pairwise(&r, k, &t);
        out[0] += 0.0 + t.s;
        out[1] += 0.0 + t.ss;
        if (t.amax > out[2])
            out[2] = t.amax;
    }
    return isfinite(out[0]) && isfinite(out[1]) && isfinite(out[2]) ? 0 : 1;
}
