/* expert/serialize.c: the checkpoint format, a block's state as bytes
 * (docs/expert.md, "Checkpoint / serialisation format"):
 * expert_block_serialize writes format 2 (format 3 for the transformer
 * kinds), expert_block_deserialize reads formats 1 to 3 and trusts nothing
 * in them, expert_ckpt_peek reads a
 * header alone and expert_block_ckpt_fits says whether it names this
 * block.
 *
 * Its own file rather than part of expert/checkpoint.c: the format is what
 * peers exchange (a newcomer downloads a holder's state in it) as well as
 * what files hold, while checkpoint.c is the file system's side (atomic
 * writes, loading with a sentence, stale temporary files), built on the
 * functions here. It reaches into a block only through
 * expert/block_internal.h.
 */
#include "expert/block.h"
#include "expert/block_internal.h"
#include "expert/model.h"
#include "expert/optim.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <zlib.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the checkpoint format stores floats little-endian; port the (de)serialiser first"
#endif

/* Format 1: the 64-byte header, the table, the data, the CRC. Format 2 adds
 * the stage (hash, model name, stage name) after the first 64 bytes; format
 * 3 then the transformer kinds' sizes (dim, heads, seq, layers, vocab);
 * format 4 (always with optimizer state) those sizes for every kind (0 for
 * the others), then the training state beyond the moments: the guard's
 * history of gradient norms, and whether DiLoCo's outer state (anchor,
 * momentum, residual: three more sets of tensors) follows. */
#define HDR_LEN_V1 64
#define HDR_LEN_V2 200
#define HDR_LEN_V3 220
#define HDR_LEN_V4 260
#define ENTRY_LEN 48
static const char magic[8] = { 'S', 'T', 'R', 'L', 'C', 'K', 'P', 'T' };

/* Table roles: parameters, the moments, then DiLoCo's outer state. */
enum { ROLE_PARAM = 0, ROLE_M = 1, ROLE_V = 2, ROLE_ANCHOR = 3, ROLE_MOMENTUM = 4, ROLE_RESIDUAL = 5 };

/* Sets of tensors (roles) a state holds. */
static int n_sets(int with_optim, int with_outer)
{
    return with_optim ? (with_outer ? 6 : 3) : 1;
}

static size_t n_entries(int nt, int with_optim, int with_outer)
{
    return (size_t)nt * (size_t)n_sets(with_optim, with_outer);
}

static size_t hdr_len(uint32_t format)
{
    return format == 1 ? HDR_LEN_V1 : format == 2 ? HDR_LEN_V2 : format == 3 ? HDR_LEN_V3 : HDR_LEN_V4;
}

/* The format a block's state is written in: 4 with optimizer state (the
 * whole training state); without, 2, the format older builds read, unless
 * the config needs format 3's fields. */
static uint32_t format_for(const struct expert_block_config *cfg, int with_optim)
{
    if (with_optim)
        return 4;
    return expert_block_kind_is_seq(cfg->kind) ? 3 : 2;
}

static size_t state_len(uint32_t format, int nt, size_t nfloats, int with_optim, int with_outer)
{
    size_t k = (size_t)n_sets(with_optim, with_outer);
    return hdr_len(format) + ENTRY_LEN * (size_t)nt * k + sizeof(float) * nfloats * k + 4;
}

/* Integers are little-endian. */
static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Doubles are IEEE-754 binary64, little-endian. */
static void put_f64(uint8_t *p, double d)
{
    uint64_t v;
    memcpy(&v, &d, sizeof v);
    put_u64(p, v);
}

static double get_f64(const uint8_t *p)
{
    uint64_t v = get_u64(p);
    double d;
    memcpy(&d, &v, sizeof d);
    return d;
}

size_t expert_block_serialized_size(const expert_block *b, int with_optim)
{
    int nt;
    size_t n;
    with_optim = with_optim != 0;
    expert_block_tensors(b, &nt, &n);
    return state_len(format_for(expert_block_config(b), with_optim), nt, n, with_optim,
                     with_optim && expert__block_has_outer(b));
}

/* A name field: printable ASCII, NUL-terminated, zero after the NUL. */
static int get_name(const uint8_t *p, char *out)
{
    size_t n = 0;
    while (n < EXPERT_CKPT_NAME_LEN && p[n])
        n++;
    if (n == EXPERT_CKPT_NAME_LEN)
        return -EBADMSG;
    for (size_t i = 0; i < n; i++)
        if (p[i] < 0x21 || p[i] > 0x7e)
            return -EBADMSG;
    for (size_t i = n; i < EXPERT_CKPT_NAME_LEN; i++)
        if (p[i])
            return -EBADMSG;
    memcpy(out, p, n + 1);
    return 0;
}

/* "<model>.<index>": the index as expert_stage_parse wants it. */
static int stage_index(const char *model, const char *stage)
{
    size_t ml = strlen(model);
    if (strncmp(stage, model, ml) != 0 || stage[ml] != '.')
        return -1;
    const char *d = stage + ml + 1;
    if (!*d || (d[0] == '0' && d[1]) || strlen(d) > 9)
        return -1;
    int v = 0;
    for (; *d; d++) {
        if (*d < '0' || *d > '9')
            return -1;
        v = v * 10 + (*d - '0');
    }
    return v;
}

int expert_ckpt_peek(const void *buf, size_t len, struct expert_ckpt_info *out)
{
    if (!buf || !out)
        return -EINVAL;
    const uint8_t *p = buf;
    memset(out, 0, sizeof *out);
    if (len < 12 || memcmp(p, magic, 8) != 0)
        return -EBADMSG;
    out->format = get_u32(p + 8);
    if (out->format < 1 || out->format > EXPERT_CKPT_FORMAT)
        return -EPROTONOSUPPORT;
    if (len < hdr_len(out->format))
        return -EBADMSG;
    uint32_t flags = get_u32(p + 12);
    if (flags & ~1u)
        return -EBADMSG;
    out->with_optim = (int)(flags & 1u);
    out->config_hash = get_u64(p + 16);
    out->version = get_u64(p + 24);
    out->steps = get_u64(p + 32);
    uint32_t dims[4];
    for (int i = 0; i < 4; i++) {
        dims[i] = get_u32(p + 40 + 4 * i);
        if (dims[i] > EXPERT_BLOCK_MAX_ROW)
            return -EBADMSG;
    }
    out->cfg = (struct expert_block_config){ (int)dims[0], (int)dims[1], (int)dims[2], (int)dims[3],
                                             0, 0, 0, 0, 0 };
    if (out->format >= 3) {
        int *more[5] = { &out->cfg.dim, &out->cfg.heads, &out->cfg.seq, &out->cfg.layers,
                         &out->cfg.vocab };
        for (int i = 0; i < 5; i++) {
            uint32_t v = get_u32(p + HDR_LEN_V2 + 4 * i);
            if (v > EXPERT_BLOCK_MAX_VOCAB)
                return -EBADMSG;
            *more[i] = (int)v;
        }
    }
    if (out->format == 4) {
        /* Always with optimizer state; the guard's history in range; the
         * reserved bytes zero. */
        double ref = get_f64(p + HDR_LEN_V3), warm = get_f64(p + HDR_LEN_V3 + 16);
        uint32_t outer = get_u32(p + HDR_LEN_V3 + 24);
        if (!out->with_optim || !(ref >= 0 && ref <= 1e300) || !(warm >= 0 && warm <= 1e300) || outer > 1 ||
            get_u32(p + HDR_LEN_V3 + 28) || get_u64(p + HDR_LEN_V3 + 32))
            return -EBADMSG;
        out->with_outer = (int)outer;
    } else if (out->format > 1 && out->format != format_for(&out->cfg, 0)) {
        return -EBADMSG; /* a transformer kind needs format 3's fields, the others format 2 */
    }
    struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
    size_t nfloats;
    int nt = expert_block_config_tensors(&out->cfg, t, &nfloats);
    /* The config hash is not checked against the dims: it also covers the
     * fixed numerics, and a file of another build's numerics is another
     * config (-ESTALE from expert_block_ckpt_fits), not corruption. */
    if (nt < 0)
        return -EBADMSG;
    if (get_u32(p + 60) != (uint32_t)n_entries(nt, out->with_optim, out->with_outer))
        return -EBADMSG;
    out->total_len = state_len(out->format, nt, nfloats, out->with_optim, out->with_outer);
    if (out->format == 1)
        return 0;
    out->stage_hash = get_u64(p + 64);
    if (get_name(p + 72, out->model) != 0 || get_name(p + 72 + EXPERT_CKPT_NAME_LEN, out->stage) != 0)
        return -EBADMSG;
    if (!out->stage_hash && !out->model[0] && !out->stage[0])
        return 0; /* a block that was never told its stage */
    int index = stage_index(out->model, out->stage);
    if (!out->model[0] || index < 0 ||
        out->stage_hash != expert_stage_hash_of(out->model, index, out->config_hash))
        return -EBADMSG;
    return 0;
}


int expert_block_ckpt_fits(const expert_block *b, const struct expert_ckpt_info *info)
{
    if (!b || !info)
        return -EINVAL;
    const struct expert_block_config *cfg = expert_block_config(b);
    uint64_t stage_hash;
    const char *stage = expert_block_stage(b, &stage_hash);
    if (info->config_hash != expert_block_config_hash(cfg) ||
        memcmp(&info->cfg, cfg, sizeof *cfg) != 0)
        return -ESTALE;
    if (stage[0] && info->stage[0] &&
        (strcmp(info->stage, stage) != 0 || strcmp(info->model, expert__block_model(b)) != 0 ||
         info->stage_hash != stage_hash))
        return -ESTALE;
    return 0;
}

/* Writes the header (hdr_len(format_for(cfg, with_optim)) bytes, zeroed
 * by the caller) of st, a block of config cfg with ne table entries. */
static void put_header(uint8_t *p, const struct expert_block_config *cfg,
                       const struct expert__block_state *st, int with_optim, int with_outer, size_t ne)
{
    memcpy(p, magic, 8);
    uint32_t format = format_for(cfg, with_optim);
    put_u32(p + 8, format);
    put_u32(p + 12, (uint32_t)with_optim);
    put_u64(p + 16, expert_block_config_hash(cfg));
    put_u64(p + 24, st->version);
    put_u64(p + 32, with_optim ? st->steps : 0);
    put_u32(p + 40, (uint32_t)cfg->kind);
    put_u32(p + 44, (uint32_t)cfg->in);
    put_u32(p + 48, (uint32_t)cfg->out);
    put_u32(p + 52, (uint32_t)cfg->hidden);
    put_u32(p + 56, with_optim ? (uint32_t)st->optim_kind : 0);
    put_u32(p + 60, (uint32_t)ne);
    put_u64(p + 64, st->stage_hash);
    memcpy(p + 72, st->model, strlen(st->model));
    memcpy(p + 72 + EXPERT_CKPT_NAME_LEN, st->stage, strlen(st->stage));
    if (format >= 3) {
        put_u32(p + HDR_LEN_V2, (uint32_t)cfg->dim);
        put_u32(p + HDR_LEN_V2 + 4, (uint32_t)cfg->heads);
        put_u32(p + HDR_LEN_V2 + 8, (uint32_t)cfg->seq);
        put_u32(p + HDR_LEN_V2 + 12, (uint32_t)cfg->layers);
        put_u32(p + HDR_LEN_V2 + 16, (uint32_t)cfg->vocab);
    }
    if (format == 4) {
        put_f64(p + HDR_LEN_V3, st->guard.ref);
        put_u64(p + HDR_LEN_V3 + 8, st->guard.seen);
        put_f64(p + HDR_LEN_V3 + 16, st->guard.warm);
        put_u32(p + HDR_LEN_V3 + 24, (uint32_t)with_outer);
    }
}

long expert_block_serialize(expert_block *b, int with_optim, void *buf, size_t cap)
{
    if (!b || !buf)
        return -EINVAL;
    with_optim = with_optim != 0;
    uint8_t *p = buf;
    int nt;
    size_t n;
    const struct expert_tensor_info *t = expert_block_tensors(b, &nt, &n);
    const struct expert_block_config *cfg = expert_block_config(b);
    struct expert__block_state st;

    /* The lock keeps a step from changing m/v or the weights, and a round
     * from changing the outer state, while we copy. */
    int rc = expert__block_state_lock(b, &st);
    if (rc != 0)
        return rc;
    int with_outer = with_optim && st.outer;
    size_t len = state_len(format_for(cfg, with_optim), nt, n, with_optim, with_outer);
    if (cap < len) {
        expert__block_state_unlock(b, &st);
        return -ENOSPC;
    }
    size_t ne = n_entries(nt, with_optim, with_outer);
    size_t hl = hdr_len(format_for(cfg, with_optim));
    size_t data_off = hl + ENTRY_LEN * ne;
    memset(p, 0, data_off);
    put_header(p, cfg, &st, with_optim, with_outer, ne);
    const float *src[6] = { st.params, st.m, st.v, st.outer, st.outer ? st.outer + n : NULL,
                            st.outer ? st.outer + 2 * n : NULL };
    size_t off = data_off;
    for (size_t e = 0; e < ne; e++) {
        const struct expert_tensor_info *te = &t[e % (size_t)nt];
        int role = (int)(e / (size_t)nt);
        uint8_t *q = p + hl + ENTRY_LEN * e;
        memcpy(q, te->name, strlen(te->name));
        put_u32(q + 24, (uint32_t)role);
        put_u32(q + 28, 0); /* dtype 0 = f32 little-endian */
        put_u64(q + 32, off);
        put_u64(q + 40, te->count);
        memcpy(p + off, src[role] + te->offset, te->count * sizeof(float));
        off += te->count * sizeof(float);
    }
    expert__block_state_unlock(b, &st);
    put_u32(p + off, (uint32_t)crc32_z(0L, p, off));
    return (long)len;
}

/* 0 when the table at q (ne entries of a header of length hl) is exactly
 * the canonical one for tensors t[0..nt) and the data ends at end: every
 * name, role, dtype, offset and count checked, so no field can point
 * outside the buffer. -EBADMSG otherwise. */
static int check_table(const uint8_t *q, size_t hl, size_t ne,
                       const struct expert_tensor_info *t, int nt, size_t end)
{
    size_t off = hl + ENTRY_LEN * ne;
    for (size_t e = 0; e < ne; e++, q += ENTRY_LEN) {
        const struct expert_tensor_info *te = &t[e % (size_t)nt];
        char name[EXPERT_TENSOR_NAME_LEN] = { 0 };
        memcpy(name, te->name, strlen(te->name));
        if (memcmp(q, name, EXPERT_TENSOR_NAME_LEN) != 0 ||
            get_u32(q + 24) != (uint32_t)(e / (size_t)nt) || get_u32(q + 28) != 0 ||
            get_u64(q + 32) != off || get_u64(q + 40) != te->count)
            return -EBADMSG;
        off += te->count * sizeof(float);
    }
    return off == end ? 0 : -EBADMSG;
}

int expert_block_deserialize(expert_block *b, const void *buf, size_t len)
{
    if (!b || (!buf && len))
        return -EINVAL;
    const uint8_t *p = buf;
    if (len < 12 || memcmp(p, magic, 8) != 0)
        return -EBADMSG;
    uint32_t format = get_u32(p + 8);
    if (format < 1 || format > EXPERT_CKPT_FORMAT)
        return -EPROTONOSUPPORT;
    size_t hl = hdr_len(format);
    if (len < hl + 4 || get_u32(p + len - 4) != (uint32_t)crc32_z(0L, p, len - 4))
        return -EBADMSG;
    struct expert_ckpt_info h;
    int rc = expert_ckpt_peek(p, len - 4, &h);
    if (rc != 0)
        return rc;
    /* Another block or stage is a mismatch, not corruption: say so. */
    rc = expert_block_ckpt_fits(b, &h);
    if (rc != 0)
        return rc;
    int with_optim = h.with_optim, with_outer = h.with_outer;
    uint64_t version = h.version, steps = h.steps;
    uint32_t okind = get_u32(p + 56);
    if (with_optim ? (okind != 0 && okind != EXPERT_OPTIM_ADAMW && okind != EXPERT_OPTIM_SGD)
                   : (okind != 0 || steps != 0))
        return -EBADMSG;
    if (with_optim && (okind == 0) != (steps == 0))
        return -EBADMSG;
    int nt;
    size_t n;
    const struct expert_tensor_info *t = expert_block_tensors(b, &nt, &n);
    size_t ne = n_entries(nt, with_optim, with_outer);
    if (len != h.total_len)
        return -EBADMSG;
    if (check_table(p + hl, hl, ne, t, nt, len - 4) != 0)
        return -EBADMSG;
    /* Non-finite weights would poison every forward: refuse them. */
    const uint8_t *src = p + hl + ENTRY_LEN * ne;
    size_t nf = n * (size_t)n_sets(with_optim, with_outer);
    for (size_t i = 0; i < nf; i++) {
        float x;
        memcpy(&x, src + i * sizeof x, sizeof x);
        if (!isfinite(x))
            return -EBADMSG;
    }
    if (!with_optim) /* weights alone: the optimizer starts afresh on them */
        return expert__block_restore(b, src, NULL, NULL, version, 0, 0, NULL);
    struct expert__train_extra extra = { .guard = { 0 } }, *ex = NULL;
    if (h.format == 4) {
        extra.guard.ref = get_f64(p + HDR_LEN_V3);
        extra.guard.seen = get_u64(p + HDR_LEN_V3 + 8);
        extra.guard.warm = get_f64(p + HDR_LEN_V3 + 16);
        extra.outer = with_outer ? src + 3 * n * sizeof(float) : NULL;
        ex = &extra;
    }
    return expert__block_restore(b, src, src + n * sizeof(float), src + 2 * n * sizeof(float), version,
                                 steps, (int)okind, ex);
}
