/* attention: scaled dot-product attention of L query positions over a static KV
 * cache, F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
 * scale=scale, enable_gqa=True): one position in a decode step, several in a
 * prefill chunk or a verify step, whose causality the mask carries.
 *
 * Query head h reads cache head h / (Hq / Hkv) in place: no K/V is copied per
 * head (HF's repeat_kv). Only positions the mask keeps are read (bool mask: true;
 * additive mask: above bfloat16's finfo.min), so the cost follows the valid
 * length, not S. Scores dot(q, k) * scale + additive mask, softmax with the max
 * subtracted, all in f32, as PyTorch's CPU flash attention computes them; like
 * it, the probabilities are rounded to the cache's dtype before they multiply V
 * (their sum is not), and the output is Σ p·v times 1 / Σ p, rounded once to its
 * dtype. A row the mask drops whole is what SDPA makes of it (see
 * kw__attn_unkept_row).
 *
 * A one-position step is a matrix-vector product per query head: threads split
 * the B·Hq heads, and the heads sharing a cache head follow each other so its
 * K/V rows are read from cache. A step of several positions is matrix products:
 * threads split blocks of query rows of one cache head (see kw__attn), each
 * block's rows share every K/V element they load, and each thread transposes a
 * cache head's keys once for all its blocks. */
#include "attention.h"

static int attention_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *o = &c->t[0], *q = &c->t[1], *k = &c->t[2], *v = &c->t[3], *m = &c->t[4];
    kw__attn *a = prep;
    if (!kw__present(q) || !kw__is_float(q->dtype) || q->ndim != 4 || (q->shape[3] > 1 && q->stride[3] != 1))
        return kw__fail(msg, len, KW_ESHAPE, "attention: q must be float32 or bfloat16 [B, Hq, L, D] with contiguous D (got %s)",
                        kw__shape(q).s);
    a->B = q->shape[0], a->Hq = q->shape[1], a->L = q->shape[2], a->D = q->shape[3];
    if (!kw__present(k) || !kw__is_float(k->dtype) || k->ndim != 4 || k->shape[0] != a->B || k->shape[3] != a->D ||
        k->shape[1] < 1 || a->Hq % k->shape[1] || (a->D > 1 && k->stride[3] != 1))
        return kw__fail(msg, len, KW_ESHAPE,
                        "attention: k_cache must be float32 or bfloat16 [B, Hkv, S, D] with Hq %% Hkv == 0, D == %lld and "
                        "contiguous D (got %s)", (long long)a->D, kw__shape(k).s);
    a->Hkv = k->shape[1], a->S = k->shape[2], a->G = a->Hq / a->Hkv;
    if (!kw__present(v) || !kw__is_float(v->dtype) || v->ndim != 4 || v->shape[0] != a->B || v->shape[1] != a->Hkv ||
        v->shape[2] != a->S || (v->shape[3] > 1 && v->stride[3] != 1))
        return kw__fail(msg, len, KW_ESHAPE, "attention: v_cache must be float32 or bfloat16 [B, Hkv, S, Dv] like k_cache %s (got %s)",
                        kw__shape(k).s, kw__shape(v).s);
    a->Dv = v->shape[3];
    if (!kw__present(o) || o->dtype != q->dtype || o->ndim != 4 || o->shape[0] != a->B || o->shape[1] != a->Hq ||
        o->shape[2] != a->L || o->shape[3] != a->Dv || (a->Dv > 1 && o->stride[3] != 1))
        return kw__fail(msg, len, KW_ESHAPE, "attention: out must be %s [B, Hq, L, Dv] = [%lld, %lld, %lld, %lld] (got %s)",
                        kw_dtype_name(q->dtype), (long long)a->B, (long long)a->Hq, (long long)a->L, (long long)a->Dv,
                        kw__shape(o).s);
    if (kw__present(m)) {
        if ((m->dtype != KW_BOOL && !kw__is_float(m->dtype)) || m->ndim != 4 || (m->shape[0] != a->B && m->shape[0] != 1) ||
            (m->shape[1] != a->Hq && m->shape[1] != 1) || (m->shape[2] != a->L && m->shape[2] != 1) ||
            m->shape[3] != a->S || (a->S > 1 && m->stride[3] != 1))
            return kw__fail(msg, len, KW_ESHAPE,
                            "attention: mask must be bool, float32 or bfloat16 [B or 1, Hq = %lld or 1, L = %lld or 1, "
                            "S = %lld] with contiguous S (got %s)", (long long)a->Hq, (long long)a->L, (long long)a->S,
                            kw__shape(m).s);
        a->mt = m->dtype, a->ms = m->shape[0] == 1 ? 0 : m->stride[0];
        a->mh = m->shape[1] == 1 ? 0 : m->stride[1], a->ml = m->shape[2] == 1 ? 0 : m->stride[2];
    }
    a->ot = o->dtype, a->qt = q->dtype, a->kt = k->dtype, a->vt = v->dtype;
    for (int d = 0; d < 3; d++) a->os[d] = o->stride[d], a->qs[d] = q->stride[d];
    for (int d = 0; d < 3; d++) a->ks[d] = k->stride[d], a->vs[d] = v->stride[d];
    a->scale = (float)c->fp[0];
    a->amx = a->L > 1 && isa >= KW_ISA_AMX && kw__attn_amx_fits(a) && a->L * a->G >= KW__ATTN_ROWS_AMX;
    a->rows = a->amx ? KW__ATTN_ROWS_AMX : KW__ATTN_ROWS;
    a->blocks = a->L > 1 ? (a->L * a->G + a->rows - 1) / a->rows : 0;
    a->units = a->blocks ? a->B * a->Hkv * a->blocks : a->B * a->L * a->Hq;
    a->run = a->amx ? kw__attention_blocks_amx
             : a->blocks ? KW__PICK(kw__attention_blocks, isa) : KW__PICK(kw__attention_heads, isa);
    return 0;
}

/* SDPA adds the mask and takes the softmax over every position: where a row's
 * additive mask is finite but at or below the threshold everywhere (HF's
 * finfo.min on a padding row), dot · scale + mask rounds to the mask value, and
 * the row is the mean of V over the positions holding the row's largest mask
 * value. So such a row is computed like a kept one over its finite positions;
 * a bool mask or -inf everywhere leaves none, and the row is zeros, as torch's
 * SDPA on the CPU gives. Padding rows only: scalar code. */
void kw__attn_unkept_row(const kw__attn *a, const kw__attn_scratch *w, int64_t b, int64_t i, int64_t h) {
    const char *mrow = kw__attn_mask_row(a, b, h, i);
    const int64_t kh = h / a->G, qo = b * a->qs[0] + h * a->qs[1] + i * a->qs[2];
    const int64_t oo = b * a->os[0] + h * a->os[1] + i * a->os[2];
    float m = -INFINITY, sum = 0.0f;
    for (int64_t s = 0; a->mt != KW_BOOL && s < a->S; s++) {
        const float bias = kw__ldf(mrow, s, a->mt);
        w->scores[s] = -INFINITY;
        if (!(bias > -INFINITY)) continue;
        const int64_t ko = b * a->ks[0] + kh * a->ks[1] + s * a->ks[2];
        float dot = 0.0f;
        for (int64_t d = 0; d < a->D; d++) dot += kw__ldf(a->q, qo + d, a->qt) * kw__ldf(a->k, ko + d, a->kt);
        w->scores[s] = dot * a->scale + bias;
        m = fmaxf(m, w->scores[s]);
    }
    for (int64_t d = 0; d < a->Dv; d++) w->acc[d] = 0.0f;
    for (int64_t s = 0; m > -INFINITY && s < a->S; s++) {
        if (w->scores[s] == -INFINITY) continue;
        const float p = expf(w->scores[s] - m), pv = kw__round_to(p, a->vt);
        const int64_t vo = b * a->vs[0] + kh * a->vs[1] + s * a->vs[2];
        sum += p;
        for (int64_t d = 0; d < a->Dv; d++) w->acc[d] += pv * kw__ldf(a->v, vo + d, a->vt);
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t d = 0; d < a->Dv; d++) kw__stf(a->o, oo + d, a->ot, w->acc[d] * inv);
}

static int64_t scan_scalar(const char *mrow, const kw__attn *a, int32_t *pos) {
    int64_t n = 0;
    for (int64_t s = 0; s < a->S; s++)
        if (!mrow || kw__attn_keep(a, mrow, s)) pos[n++] = (int32_t)s;
    return n;
}

void kw__attention_heads_scalar(const kw__attn *a, int64_t u0, int64_t u1, void *work) {
    const kw__attn_scratch w = kw__attn_carve(a, work);
    int64_t cur_mrow = -1, n = 0;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t row = u / a->Hq, b = row / a->L, i = row % a->L, h = u % a->Hq, kh = h / a->G;
        const char *mrow = kw__attn_mask_row(a, b, h, i);
        if ((a->mh ? u : row) != cur_mrow) n = scan_scalar(mrow, a, w.pos), cur_mrow = a->mh ? u : row;
        if (n == 0) {
            kw__attn_unkept_row(a, &w, b, i, h);
            continue;
        }
        const int64_t qo = b * a->qs[0] + h * a->qs[1] + i * a->qs[2], oo = b * a->os[0] + h * a->os[1] + i * a->os[2];
        float m = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const int64_t ko = b * a->ks[0] + kh * a->ks[1] + w.pos[j] * a->ks[2];
            float dot = 0.0f;
            for (int64_t d = 0; d < a->D; d++) dot += kw__ldf(a->q, qo + d, a->qt) * kw__ldf(a->k, ko + d, a->kt);
            w.scores[j] = dot * a->scale + kw__attn_bias(a, mrow, w.pos[j]);
            m = fmaxf(m, w.scores[j]);
        }
        for (int64_t d = 0; d < a->Dv; d++) w.acc[d] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float p = expf(w.scores[j] - m);
            const int64_t vo = b * a->vs[0] + kh * a->vs[1] + w.pos[j] * a->vs[2];
            const float pv = kw__round_to(p, a->vt);
            sum += p;
            for (int64_t d = 0; d < a->Dv; d++) w.acc[d] += pv * kw__ldf(a->v, vo + d, a->vt);
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < a->Dv; d++) kw__stf(a->o, oo + d, a->ot, w.acc[d] * inv);
    }
}

/* The reference has no blocks: it runs a block's rows as heads. */
void kw__attention_blocks_scalar(const kw__attn *a, int64_t u0, int64_t u1, void *work) {
    for (int64_t u = u0; u < u1; u++) {
        int64_t b, kh, r0;
        kw__attn_block_of(a, u, &b, &kh, &r0);
        for (int64_t r = r0; r < KW__MIN(r0 + a->rows, a->L * a->G); r++) {
            const int64_t hu = (b * a->L + r / a->G) * a->Hq + kh * a->G + r % a->G;
            kw__attention_heads_scalar(a, hu, hu + 1, work);
        }
    }
}

static size_t attention_work(const void *prep) { return kw__attn_work_size(prep); }

static void attention_kernel(const kw_call *c, int ith, int nth) {
    kw__attn a = *(const kw__attn *)c->prep;
    int64_t u0, u1;
    a.o = c->t[0].data, a.q = c->t[1].data, a.k = c->t[2].data, a.v = c->t[3].data, a.mask = c->t[4].data;
    kw__split(a.units, 1, ith, nth, &u0, &u1);
    if (u0 < u1) a.run(&a, u0, u1, kw__work(c, ith));
}

/* Slots out [B, Hq, L, Dv], q [B, Hq, L, D], k_cache [B, Hkv, S, D],
 * v_cache [B, Hkv, S, Dv], mask [B or 1, Hq or 1, L or 1, S] (optional; bool or additive:
 * T5's relative position bias is one per head);
 * fp[0] scale. */
const kw_op_info kw_op_info_attention = {
    .name = "attention",
    .n_tensors = 5,
    .arg = {{"out", KW_WRITE, 0}, {"q", KW_READ, 0}, {"k_cache", KW_READ, 0}, {"v_cache", KW_READ, 0}, {"mask", KW_READ, 1}},
    .n_fp = 1,
    .prepare = attention_prepare,
    .prep_size = sizeof(kw__attn),
    .work_size = attention_work,
    .kernel = attention_kernel,
};
