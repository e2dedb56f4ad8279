/* The routing network's forward pass for one decision, in plain C (router/policy/fastnet.py explains when it
 * is used and how it is checked against onnxruntime).
 *
 * At one decision the network is tiny (a few hundred thousand multiply-adds at 16 replicas), so onnxruntime's
 * cost is per-operator overhead and numpy's is per-call overhead; one compiled pass over contiguous memory
 * does the same arithmetic in a few microseconds.
 *
 *   logits(rows, n_rows, weights, dims, out)   out = the exported graph's logits, float32
 *
 * rows: build_features rows, float32 [n_rows, F], made into the network's input by cross.c (the cross-replica
 * inputs bound from router/policy/feature_table.py); weights: one float32 blob in the layout of
 * fastnet.pack_layout; dims: (F, C, hidden, heads, layers, ff, has_prior, wait_col).
 */
#include "fastnet.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* x86-64 builds carry an x86-64-v3 (AVX2+FMA) copy of the hot loops, chosen at load by the CPU (portable wheels, fast loops). */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* GCC vector types: the accumulators below are named registers, not arrays (GCC keeps a float[32]
 * accumulator on the stack, and the store-to-load round trip then bounds every FMA chain). */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
typedef int v8i __attribute__((vector_size(32), aligned(4)));
static inline v8 splat8(float x) { return (v8){0} + x; } /* a vector-scalar operation broadcasts */
static inline v8 max8(v8 a, v8 b)
{
    const v8i gt = a > b;
    return (v8)((gt & (v8i)a) | (~gt & (v8i)b));
}

/* out[r, :] = b + x[r, :] @ w, w row-major [k, m]. Three rows at a time, 32 columns at a time: twelve
 * independent FMA chains keep both FMA units busy (one row alone waits on the FMA latency), each weight load
 * serves three rows, and the twelve accumulators and four weight vectors fill the sixteen registers. */
VECTOR_CLONES static void linear(const float *restrict x, int R, int k, const float *restrict w, const float *restrict b, int m,
                                 float *restrict out)
{
    int r = 0;
    for (; r + 3 <= R; r += 3) {
        const float *restrict x0 = x + (size_t)r * k, *restrict x1 = x0 + k, *restrict x2 = x1 + k;
        float *restrict o0 = out + (size_t)r * m, *restrict o1 = o0 + m, *restrict o2 = o1 + m;
        int j0 = 0;
        for (; j0 + 32 <= m; j0 += 32) {
            v8 a0 = load8(b + j0), a1 = load8(b + j0 + 8), a2 = load8(b + j0 + 16), a3 = load8(b + j0 + 24);
            v8 c0 = a0, c1 = a1, c2 = a2, c3 = a3, d0 = a0, d1 = a1, d2 = a2, d3 = a3;
            for (int i = 0; i < k; i++) {
                const float *wi = w + (size_t)i * m + j0;
                const v8 w0 = load8(wi), w1 = load8(wi + 8), w2 = load8(wi + 16), w3 = load8(wi + 24);
                v8 u = splat8(x0[i]);
                a0 += u * w0; a1 += u * w1; a2 += u * w2; a3 += u * w3;
                u = splat8(x1[i]);
                c0 += u * w0; c1 += u * w1; c2 += u * w2; c3 += u * w3;
                u = splat8(x2[i]);
                d0 += u * w0; d1 += u * w1; d2 += u * w2; d3 += u * w3;
            }
            store8(o0 + j0, a0); store8(o0 + j0 + 8, a1); store8(o0 + j0 + 16, a2); store8(o0 + j0 + 24, a3);
            store8(o1 + j0, c0); store8(o1 + j0 + 8, c1); store8(o1 + j0 + 16, c2); store8(o1 + j0 + 24, c3);
            store8(o2 + j0, d0); store8(o2 + j0 + 8, d1); store8(o2 + j0 + 16, d2); store8(o2 + j0 + 24, d3);
        }
        for (int j = j0; j < m; j++)
            o0[j] = o1[j] = o2[j] = b[j];
        for (int i = 0; i < k && j0 < m; i++) {
            const float v0 = x0[i], v1 = x1[i], v2 = x2[i];
            const float *restrict wi = w + (size_t)i * m;
            for (int j = j0; j < m; j++) {
                o0[j] += v0 * wi[j];
                o1[j] += v1 * wi[j];
                o2[j] += v2 * wi[j];
            }
        }
    }
    for (; r < R; r++) {
        const float *restrict xr = x + (size_t)r * k;
        float *restrict o = out + (size_t)r * m;
        for (int j = 0; j < m; j++)
            o[j] = b[j];
        for (int i = 0; i < k; i++) {
            const float v = xr[i];
            const float *restrict wi = w + (size_t)i * m;
            for (int j = 0; j < m; j++)
                o[j] += v * wi[j];
        }
    }
}

/* Reductions in LANES partial results, so that they vectorise without reassociation flags (-ffast-math would
 * also change isnan/isfinite in py_rows). */
#define LANES 8
static inline float sum_lanes(const float *x, int n)
{
    float part[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++)
            part[j] += x[i + j];
    float t = 0.0f;
    for (; i < n; i++)
        t += x[i];
    for (int j = 0; j < LANES; j++)
        t += part[j];
    return t;
}

/* erf as a rational function on [-4, 4] (Eigen's generic_fast_erf_float; |error| < 4e-7, below float32's
 * resolution near 1): unlike libm's erff it vectorises, and GELU runs on every hidden unit. */
static inline float erf_fast(float x)
{
    x = x < -4.0f ? -4.0f : (x > 4.0f ? 4.0f : x);
    const float x2 = x * x;
    float p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
    p = p * x2 + -2.10102402082508e-06f;
    p = p * x2 + -5.69250639462346e-05f;
    p = p * x2 + -7.34990630326855e-04f;
    p = p * x2 + -2.95459980854025e-03f;
    p = p * x2 + -1.60960333262415e-02f;
    float q = x2 * -1.45660718464996e-05f + -2.13374055278905e-04f;
    q = q * x2 + -1.68282697438203e-03f;
    q = q * x2 + -7.37332916720468e-03f;
    q = q * x2 + -1.42647390514189e-02f;
    return x * p / q;
}

/* exp of eight softmax arguments (<= 0, or NaN, which stays NaN): Cephes' expf polynomial, |relative error|
 * ~1e-7, and exactly 0 below -87 (a masked key), where expf would return a denormal; in vector form, since
 * libm's expf does not vectorise. n = round(x / ln 2) by the 1.5 x 2^23 trick: the sum's low mantissa bits
 * are n itself, so no float-int conversions. */
static inline v8 exp8(v8 x)
{
    const v8i under = x < splat8(-87.0f);
    x = max8(splat8(-87.0f), x); /* this order keeps a NaN */
    const v8 shifted = x * 1.44269504088896341f + 12582912.0f;
    const v8 n = shifted - 12582912.0f;
    x = x - n * 0.693359375f - n * -2.12194440e-4f;
    v8 y = splat8(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    const v8 scale = (v8)(((v8i)shifted - 0x4B400000 + 127) << 23);
    return (v8)((v8i)(y * scale) & ~under);
}

/* The attention weights of all R queries at once, in place: s[i][k] = exp(s[i][k] * scale + mask penalty -
 * row max), and inv[i] = 1 / their row sum; s is one head's score matrix [R][R], made by one matrix product
 * (linear) rather than query by query. */
VECTOR_CLONES static void softmax_rows(float *restrict s, int R, float scale, const float *restrict mask, float *restrict inv)
{
    const v8 sc = splat8(scale), one = splat8(1.0f), off = splat8(-1e9f);
    for (int i = 0; i < R; i++) {
        float *restrict si = s + (size_t)i * R;
        v8 part = splat8(-INFINITY);
        int k = 0;
        for (; k + 8 <= R; k += 8) {
            const v8 v = load8(si + k) * sc + (one - load8(mask + k)) * off;
            store8(si + k, v);
            part = max8(v, part);
        }
        float mx = -INFINITY;
        for (; k < R; k++) {
            si[k] = si[k] * scale + (1.0f - mask[k]) * -1e9f;
            mx = si[k] > mx ? si[k] : mx;
        }
        for (int j = 0; j < 8; j++)
            mx = part[j] > mx ? part[j] : mx;
        inv[i] = mx; /* the row maximum, until the second pass */
    }
    for (int i = 0; i < R; i++) {
        float *restrict si = s + (size_t)i * R;
        const float mx = inv[i];
        const v8 m = splat8(mx);
        int k = 0;
        for (; k + 8 <= R; k += 8)
            store8(si + k, exp8(load8(si + k) - m));
        if (k < R) { /* the last few through a padded vector */
            float pad[8];
            for (int j = 0; j < 8; j++)
                pad[j] = k + j < R ? si[k + j] : mx;
            const v8 e = exp8(load8(pad) - m);
            for (int j = 0; k + j < R; j++)
                si[k + j] = e[j];
        }
        inv[i] = 1.0f / sum_lanes(si, R);
    }
}

VECTOR_CLONES static void gelu(float *restrict x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = 0.5f * x[i] * (1.0f + erf_fast(x[i] * 0.70710678118654752f));
}

/* sum of a vector's lanes as a tree: three dependent additions instead of eight */
static inline float hsum8(v8 v)
{
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

VECTOR_CLONES static void layernorm(const float *x, int R, int h, const float *w, const float *b, float *out)
{
    if (h % 8 == 0) { /* every width the trainer makes: the row in registers, eight lanes at a time */
        const float inv_h = 1.0f / (float)h;
        for (int r = 0; r < R; r++) {
            const float *xr = x + (size_t)r * h;
            float *o = out + (size_t)r * h;
            v8 acc = load8(xr);
            for (int j = 8; j < h; j += 8)
                acc += load8(xr + j);
            const v8 m = splat8(hsum8(acc) * inv_h);
            v8 sq = splat8(0.0f);
            for (int j = 0; j < h; j += 8) {
                const v8 d = load8(xr + j) - m;
                sq += d * d;
            }
            const v8 inv = splat8(1.0f / sqrtf(hsum8(sq) * inv_h + 1e-5f));
            for (int j = 0; j < h; j += 8)
                store8(o + j, (load8(xr + j) - m) * inv * load8(w + j) + load8(b + j));
        }
        return;
    }
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * h;
        float *o = out + (size_t)r * h;
        const float m = sum_lanes(xr, h) / (float)h;
        for (int j = 0; j < h; j++)
            o[j] = (xr[j] - m) * (xr[j] - m);
        const float v = sum_lanes(o, h) / (float)h;
        const float inv = 1.0f / sqrtf(v + 1e-5f);
        for (int j = 0; j < h; j++)
            o[j] = (xr[j] - m) * inv * w[j] + b[j];
    }
}

/* cx[z] = inv * sum_k p[k] v[k][z] for one query and head of width 16; v is [R][16]. Four keys at a time into
 * four partial sums (eight chains): one chain over all R keys would wait on the FMA latency at every key. */
VECTOR_CLONES static void attend16(int R, const float *restrict p, const float *restrict v, float inv, float *restrict cx)
{
    v8 a0 = splat8(0.0f), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
    int k = 0;
    for (; k + 4 <= R; k += 4) {
        const float *vk = v + (size_t)k * 16;
        const v8 p0 = splat8(p[k]), p1 = splat8(p[k + 1]), p2 = splat8(p[k + 2]), p3 = splat8(p[k + 3]);
        a0 += p0 * load8(vk); a1 += p0 * load8(vk + 8);
        b0 += p1 * load8(vk + 16); b1 += p1 * load8(vk + 24);
        c0 += p2 * load8(vk + 32); c1 += p2 * load8(vk + 40);
        d0 += p3 * load8(vk + 48); d1 += p3 * load8(vk + 56);
    }
    for (; k < R; k++) {
        const v8 pk = splat8(p[k]);
        a0 += pk * load8(v + (size_t)k * 16);
        a1 += pk * load8(v + (size_t)k * 16 + 8);
    }
    const v8 s = splat8(inv);
    store8(cx, ((a0 + b0) + (c0 + d0)) * s);
    store8(cx + 8, ((a1 + b1) + (c1 + d1)) * s);
}

/* attend16 for six queries at once (rows i..i+5 of p, which is [R][R]): twelve chains, and each load of a key's
 * values serves six queries instead of one. cx is the first query's output; the next ones are `stride` apart. */
VECTOR_CLONES static void attend16x6(int R, const float *restrict p, const float *restrict v, const float *restrict inv,
                                     float *restrict cx, int stride)
{
    v8 a0 = splat8(0.0f), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0, e0 = a0, e1 = a0, f0 = a0, f1 = a0;
    const float *restrict p0 = p, *restrict p1 = p0 + R, *restrict p2 = p1 + R, *restrict p3 = p2 + R, *restrict p4 = p3 + R,
                          *restrict p5 = p4 + R;
    for (int k = 0; k < R; k++) {
        const v8 v0 = load8(v + (size_t)k * 16), v1 = load8(v + (size_t)k * 16 + 8);
        v8 u = splat8(p0[k]);
        a0 += u * v0; a1 += u * v1;
        u = splat8(p1[k]);
        b0 += u * v0; b1 += u * v1;
        u = splat8(p2[k]);
        c0 += u * v0; c1 += u * v1;
        u = splat8(p3[k]);
        d0 += u * v0; d1 += u * v1;
        u = splat8(p4[k]);
        e0 += u * v0; e1 += u * v1;
        u = splat8(p5[k]);
        f0 += u * v0; f1 += u * v1;
    }
    const v8 acc[12] = {a0, a1, b0, b1, c0, c1, d0, d1, e0, e1, f0, f1};
    for (int q = 0; q < 6; q++) {
        const v8 s = splat8(inv[q]);
        store8(cx + (size_t)q * stride, acc[2 * q] * s);
        store8(cx + (size_t)q * stride + 8, acc[2 * q + 1] * s);
    }
}

/* the same for any width */
static inline void attend(int hd, int R, const float *restrict p, const float *restrict v, float inv, float *restrict cx)
{
    for (int z = 0; z < hd; z++)
        cx[z] = 0.0f;
    for (int k = 0; k < R; k++)
        for (int z = 0; z < hd; z++)
            cx[z] += p[k] * v[(size_t)k * hd + z];
    for (int z = 0; z < hd; z++)
        cx[z] *= inv;
}

/* Every array of the weight blob and of the work buffer starts on a 64-byte boundary (ALIGN floats): a
 * 32-byte load that straddles two cache lines costs two, and the weight rows are loaded at every row. The
 * blob's base is aligned by fastnet.FastNet, which pads each array to a multiple of ALIGN floats (fastnet.h). */
static inline size_t up_align(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

/* Walks the weight blob in fastnet.pack_layout's order (each array padded to ALIGN floats); returns NULL if
 * it runs past `end`. */
static const float *take(const float **p, size_t n, const float *end)
{
    const float *at = *p;
    if (at + up_align(n) > end)
        return NULL;
    *p = at + up_align(n);
    return at;
}

VECTOR_CLONES static int forward(const float *inp, const float *mask, int R, const long *dims, const float *wb, size_t wn, float *logits)
{
    const int F = (int)dims[0], C = (int)dims[1], H = (int)dims[2], heads = (int)dims[3], L = (int)dims[4],
              FF = (int)dims[5], prior = (int)dims[6], wait_col = (int)dims[7];
    if (heads <= 0 || H % heads || F > C || (prior && (wait_col < 0 || wait_col >= C)))
        return -1;
    const int hd = H / heads;
    const float *end = wb + wn, *p = wb;
    size_t big = (size_t)C;
    if ((size_t)3 * H > big)
        big = (size_t)3 * H;
    if ((size_t)FF > big)
        big = (size_t)FF;
    /* a: inputs, qkv or the feed-forward's hidden; sm: one head's scores [R][R]; qh: one head's queries */
    const size_t nRH = up_align((size_t)R * H), nR = up_align((size_t)R);
    const size_t n_buf = up_align((size_t)R * big) + 6 * nRH + up_align((size_t)R * R) + 2 * nR + up_align((size_t)R * hd);
    float *buf = aligned_alloc(64, sizeof(float) * n_buf);
    if (!buf)
        return -2;
    float *a = buf, *h = a + up_align((size_t)R * big), *y = h + nRH, *t = y + nRH, *ctx = t + nRH;
    float *kt = ctx + nRH, *vt = kt + nRH, *sm = vt + nRH, *zeros = sm + up_align((size_t)R * R);
    float *inv = zeros + nR, *qh = inv + nR;
    memset(zeros, 0, sizeof(float) * (size_t)R);
    int rc = -3;
#define TAKE(var, n)                          \
    const float *var = take(&p, (n), end);    \
    if (!var)                                 \
        goto done;
    TAKE(mu, F) TAKE(sd, F) TAKE(w0, (size_t)C * H) TAKE(b0, H) TAKE(w1, (size_t)H * H) TAKE(b1, H)
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < F; j++) {
            float v = (inp[(size_t)r * C + j] - mu[j]) / sd[j];
            a[(size_t)r * C + j] = v < -10.0f ? -10.0f : (v > 10.0f ? 10.0f : v);
        }
        memcpy(a + (size_t)r * C + F, inp + (size_t)r * C + F, sizeof(float) * (C - F));
    }
    linear(a, R, C, w0, b0, H, t);
    gelu(t, (size_t)R * H);
    linear(t, R, H, w1, b1, H, h);
    const float scale = 1.0f / sqrtf((float)hd);
    for (int l = 0; l < L; l++) {
        TAKE(n1w, H) TAKE(n1b, H) TAKE(wq, (size_t)H * 3 * H) TAKE(bq, 3 * H) TAKE(wo, (size_t)H * H) TAKE(bo, H)
        TAKE(n2w, H) TAKE(n2b, H) TAKE(wf0, (size_t)H * FF) TAKE(bf0, FF) TAKE(wf2, (size_t)FF * H) TAKE(bf2, H)
        layernorm(h, R, H, n1w, n1b, y);
        linear(y, R, H, wq, bq, 3 * H, a); /* a = qkv [R, 3H] */
        for (int k = 0; k < R; k++) { /* keys transposed [H][R] and values by head [heads][R][hd]: contiguous loops */
            const float *ak = a + (size_t)k * 3 * H + H, *av = ak + H;
            for (int j = 0; j < H; j++)
                kt[(size_t)j * R + k] = ak[j];
            for (int g = 0; g < heads; g++)
                memcpy(vt + ((size_t)g * R + k) * hd, av + (size_t)g * hd, sizeof(float) * hd);
        }
        for (int g = 0; g < heads; g++) { /* scores = q k^T as one matrix product, softmax by rows, then attend */
            for (int i = 0; i < R; i++)
                memcpy(qh + (size_t)i * hd, a + (size_t)i * 3 * H + g * hd, sizeof(float) * hd);
            linear(qh, R, hd, kt + (size_t)g * hd * R, zeros, R, sm);
            softmax_rows(sm, R, scale, mask, inv);
            const float *vh = vt + (size_t)g * R * hd;
            int i = 0;
            if (hd == 16)
                for (; i + 6 <= R; i += 6)
                    attend16x6(R, sm + (size_t)i * R, vh, inv + i, ctx + (size_t)i * H + g * hd, H);
            for (; i < R; i++) {
                float *cx = ctx + (size_t)i * H + g * hd;
                if (hd == 16)
                    attend16(R, sm + (size_t)i * R, vh, inv[i], cx);
                else
                    attend(hd, R, sm + (size_t)i * R, vh, inv[i], cx);
            }
        }
        linear(ctx, R, H, wo, bo, H, t);
        for (size_t i = 0; i < (size_t)R * H; i++)
            h[i] += t[i];
        layernorm(h, R, H, n2w, n2b, y);
        linear(y, R, H, wf0, bf0, FF, a);
        gelu(a, (size_t)R * FF);
        linear(a, R, FF, wf2, bf2, H, t);
        for (size_t i = 0; i < (size_t)R * H; i++)
            h[i] += t[i];
    }
    {
        TAKE(fnw, H) TAKE(fnb, H) TAKE(wh0, (size_t)H * H) TAKE(bh0, H) TAKE(wh2, H) TAKE(bh2, 1) TAKE(pw, 1)
        if (p != end)
            goto done;
        layernorm(h, R, H, fnw, fnb, y);
        linear(y, R, H, wh0, bh0, H, t);
        gelu(t, (size_t)R * H);
        for (int r = 0; r < R; r++) {
            float acc = bh2[0];
            for (int j = 0; j < H; j++)
                acc += t[(size_t)r * H + j] * wh2[j];
            if (prior)
                acc = acc + -pw[0] * inp[(size_t)r * C + wait_col];
            logits[r] = mask[r] > 0.5f ? acc : -1e9f;
        }
        rc = 0;
    }
#undef TAKE
done:
    free(buf);
    return rc;
}

int read_longs(PyObject *seq, long *dst, int n, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d integers, got %zd", what, n, PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        dst[i] = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (dst[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

int check_f32(Py_buffer *b, Py_ssize_t n, const char *what)
{
    if (b->len != n * (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd float32 values, got %zd bytes", what, n, b->len);
        return -1;
    }
    return 0;
}

/* The network's logits for one decision into `out` [R]; 0, or -1 with an exception set */
int run_logits(const float *rows, int R, const long *dims, const float *wb, size_t wn, float *out)
{
    const int F = (int)dims[0], C = (int)dims[1];
    float *work = malloc(sizeof(float) * (size_t)R * (C + 1));
    if (!work) {
        PyErr_NoMemory();
        return -1;
    }
    float *mask = work + (size_t)R * C;
    int rc = -1;
    if (cross_inputs(rows, R, F, work, C, "logits"))
        goto end;
    const int col = cross_mask_column();
    for (int r = 0; r < R; r++)
        mask[r] = rows[(size_t)r * F + col] > 0.5f ? 1.0f : 0.0f;
    if (forward(work, mask, R, dims, wb, wn, out)) {
        PyErr_SetString(PyExc_ValueError, "logits: the weight blob does not match the network's dimensions");
        goto end;
    }
    rc = 0;
end:
    free(work);
    return rc;
}

/* Parses (rows, n_rows, weights, dims[, out]) and runs the network into `out` (or `own`,
 * n_rows floats, when the call has no out, and then a copy of the healthy column in `healthy`); 0, or -1 with
 * an exception set. */
static int logits_call(PyObject *args, int with_out, float **own, int *R_out, const float **healthy)
{
    Py_buffer rows, wb, out = {0};
    int R;
    PyObject *dims_obj;
    long dims[8];
    const int parsed = with_out ? PyArg_ParseTuple(args, "y*iy*Ow*", &rows, &R, &wb, &dims_obj, &out)
                                : PyArg_ParseTuple(args, "y*iy*O", &rows, &R, &wb, &dims_obj);
    if (!parsed)
        return -1;
    int rc = -1;
    if (R <= 0) {
        PyErr_SetString(PyExc_ValueError, "logits: no replicas");
        goto end;
    }
    if (read_longs(dims_obj, dims, 8, "dims") || check_f32(&rows, (Py_ssize_t)R * dims[0], "rows") ||
        (with_out && check_f32(&out, R, "out")))
        goto end;
    float *dst = with_out ? out.buf : (*own = malloc(sizeof(float) * (size_t)R));
    if (!dst) {
        PyErr_NoMemory();
        goto end;
    }
    if (run_logits(rows.buf, R, dims, wb.buf, (size_t)wb.len / sizeof(float), dst))
        goto end;
    if (!with_out) { /* the caller reads the healthy column after the buffers are released: keep a copy */
        float *h = malloc(sizeof(float) * (size_t)R);
        if (!h) {
            PyErr_NoMemory();
            goto end;
        }
        for (int r = 0; r < R; r++)
            h[r] = ((const float *)rows.buf)[(size_t)r * dims[0] + cross_mask_column()];
        *healthy = h;
    }
    *R_out = R;
    rc = 0;
end:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&wb);
    if (with_out)
        PyBuffer_Release(&out);
    return rc;
}

/* logits(rows, n_rows, weights, dims, out) */
PyObject *py_logits(PyObject *self, PyObject *args)
{
    int R;
    if (logits_call(args, 1, NULL, &R, NULL))
        return NULL;
    Py_RETURN_NONE;
}

/* the first largest logit among healthy replicas (-1 if none is healthy; healthy: column `col` of `rows`, `width`
 * floats per replica) and whether every healthy replica's logit is finite */
void pick_best(const float *logit, const float *rows, int R, int width, int col, int *pick_out, int *finite_out)
{
    int pick = -1, finite = 1;
    for (int r = 0; r < R; r++) {
        if (!(rows[(size_t)r * width + col] > 0.5f))
            continue;
        const float v = logit[r];
        if (!isfinite(v))
            finite = 0;
        else if (pick < 0 || v > logit[pick])
            pick = r;
    }
    *pick_out = pick;
    *finite_out = finite;
}

/* best(rows, n_rows, weights, dims) -> (pick, finite): the first largest logit among healthy
 * replicas (-1 if none is healthy) and whether every healthy replica's logit is finite. One call instead of
 * logits() and four numpy calls, each of which costs tens of microseconds on a cold cache (a live router
 * between requests). */
PyObject *py_best(PyObject *self, PyObject *args)
{
    float *logit = NULL;
    const float *healthy = NULL;
    int R;
    if (logits_call(args, 0, &logit, &R, &healthy)) {
        free(logit);
        return NULL;
    }
    int pick, finite;
    pick_best(logit, healthy, R, 1, 0, &pick, &finite);
    free(logit);
    free((void *)healthy);
    return Py_BuildValue("(iO)", pick, finite ? Py_True : Py_False);
}
