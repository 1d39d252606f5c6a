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

/* The next k values as doubles. */
static void read_values(reader *r, double *out, int64_t k) {
    int64_t i;
    if (r->shape == NULL) {
        const char *p = r->base + r->pos * r->itemsize;
        switch (r->dtype) { /* the common dtypes as tight loops */
        case F32: for (i = 0; i < k; i++) { float v; memcpy(&v, p + 4 * i, 4); out[i] = v; } break;
        case F64: memcpy(out, p, (size_t)k * 8); break;
        case BF16: for (i = 0; i < k; i++) { uint16_t v; uint32_t b; float f; memcpy(&v, p + 2 * i, 2);
                       b = (uint32_t)v << 16; memcpy(&f, &b, 4); out[i] = f; } break;
        case I64: for (i = 0; i < k; i++) { int64_t v; memcpy(&v, p + 8 * i, 8); out[i] = (double)v; } break;
        default: for (i = 0; i < k; i++) out[i] = value_at(p + i * r->itemsize, r->dtype);
        }
        r->pos += k;
        return;
    }
    for (i = 0; i < k; i++) {
        int d;
        out[i] = value_at(r->base + r->off * r->itemsize, r->dtype);
        for (d = r->ndim - 1; d >= 0; d--) { /* the row-major odometer */
            r->off += r->strides[d];
            if (++r->idx[d] < r->shape[d])
                break;
            r->off -= r->strides[d] * r->shape[d];
            r->idx[d] = 0;
        }
    }
}

typedef struct { double s, ss, amax; } sums;

/* numpy's pairwise sum of the next n values and of their squares (see the top of this file). */
static void pairwise(reader *r, int64_t n, sums *out) {
    double x[BLOCK];
    int64_t i;
    int j;
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
        double rs[8], rq[8], am[8], s, ss, a;
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
        s = ((rs[0] + rs[1]) + (rs[2] + rs[3])) + ((rs[4] + rs[5]) + (rs[6] + rs[7]));
        ss = ((rq[0] + rq[1]) + (rq[2] + rq[3])) + ((rq[4] + rq[5]) + (rq[6] + rq[7]));
        a = am[0];
        for (j = 1; j < 8; j++)
            a = am[j] > a ? am[j] : a;
        for (; i < n; i++) {
            double m = fabs(x[i]);
            s += x[i];
            ss += x[i] * x[i];
            a = m > a ? m : a;
        }
        out->s = s;
        out->ss = ss;
        out->amax = a;
    }
}

/* out = {sum, sum of squares, max |x|} of n values of dtype at data; shape/strides (elements, ndim of them) for a
 * view that is not one dense range, NULL otherwise. Returns 0, or -1 for what it cannot read (the caller's numpy
 * path takes it). Non-finite values give non-finite sums, which the caller checks. */
int replaydiff_stats(const void *data, int dtype, int64_t n, int ndim, const int64_t *shape, const int64_t *strides,
                     int64_t chunk, double *out) {
    static const int64_t sizes[] = {8, 4, 2, 2, 8, 4, 2, 1, 1, 1};
    reader r;
    sums t;
    double first;
    if (dtype < F64 || dtype > BOOL || n <= 0 || chunk < 1 || ndim > MAXDIM || (shape != NULL && ndim < 0))
        return -1;
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
        return 0;
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
    return 0;
}
