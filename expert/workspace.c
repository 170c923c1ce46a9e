/* expert/workspace.c: a thread's activations for one block config on one
 * backend (expert_workspace, expert/block.h): the kind's views (laid out by
 * expert/ffnws.c or expert/seqws.c) and, on a backend without host memory,
 * the staging views of a call's host tensors, in one allocation of backend
 * memory; and the kept rows a backward may take instead of recomputing. */
#include "expert/block.h"
#include "expert/block_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define R64(x) (((x) + 63) & ~(size_t)63)

/* Floats of the views, and of the staging views (0 on the CPU). */
static void ws_sizes(const struct expert_block_config *cfg, const expert_backend *be, int max_batch,
                     size_t *views_out, size_t *staging_out)
{
    size_t B = (size_t)max_batch;
    if (expert_block_kind_is_seq(cfg->kind)) {
        struct expert__seq_ws tmp;
        *views_out = expert__seq_ws_layout(&tmp, cfg, &be->ops, max_batch, NULL);
    } else {
        struct expert__ffn_ws tmp;
        *views_out = expert__ffn_ws_layout(&tmp, cfg, max_batch, NULL);
    }
    *staging_out = 0;
    if (!be->host_memory)
        *staging_out = 2 * R64(B * (size_t)cfg->in) + 2 * R64(B * (size_t)cfg->out);
}

size_t expert_workspace_bytes(const struct expert_block_config *cfg, const expert_backend *be,
                              int max_batch)
{
    if (expert_block_config_check(cfg) < 0 || !be || max_batch < 1 || max_batch > (1 << 20))
        return 0;
    size_t views, staging;
    ws_sizes(cfg, be, max_batch, &views, &staging);
    return (views + staging) * sizeof(float);
}

expert_workspace *expert_workspace_create_on(const struct expert_block_config *cfg, int max_batch,
                                             const expert_backend *be)
{
    if (expert_block_config_check(cfg) < 0 || !be || max_batch < 1 || max_batch > (1 << 20))
        return NULL;
    expert_workspace *ws = calloc(1, sizeof *ws);
    if (!ws)
        return NULL;
    ws->cfg = *cfg;
    ws->be = be;
    ws->max_batch = max_batch;
    size_t views, staging;
    ws_sizes(cfg, be, max_batch, &views, &staging);
    /* LINEAR on the CPU has no view but gets one float: buf is never NULL. */
    ws->buf = be->alloc(be, (views + staging ? views + staging : 1) * sizeof(float));
    if (!ws->buf)
        goto fail;
    if (expert_block_kind_is_seq(cfg->kind)) {
        ws->seq = calloc(1, sizeof *ws->seq);
        if (!ws->seq)
            goto fail;
        expert__seq_ws_layout(ws->seq, cfg, &be->ops, max_batch, ws->buf);
        /* The tokens are checked and converted on the host. */
        ws->seq->tok = malloc((size_t)max_batch * (size_t)cfg->seq * sizeof(int32_t));
        if (!ws->seq->tok)
            goto fail;
    } else {
        expert__ffn_ws_layout(&ws->ffn, cfg, max_batch, ws->buf);
    }
    if (staging) {
        size_t B = (size_t)max_batch;
        float *p = ws->buf + views;
        ws->d_in = p;   p += R64(B * (size_t)cfg->in);
        ws->d_dinp = p; p += R64(B * (size_t)cfg->in);
        ws->d_out = p;  p += R64(B * (size_t)cfg->out);
        ws->d_dout = p;
    }
    return ws;
fail:
    if (ws->seq)
        free(ws->seq->tok);
    free(ws->seq);
    expert_backend_free(be, ws->buf);
    free(ws);
    return NULL;
}

expert_workspace *expert_workspace_create(const struct expert_block_config *cfg, int max_batch)
{
    return expert_workspace_create_on(cfg, max_batch, expert_backend_cpu());
}

void expert_workspace_destroy(expert_workspace **p)
{
    if (!p || !*p)
        return;
    expert_workspace *ws = *p;
    expert_backend_free(ws->be, ws->buf);
    if (ws->seq)
        free(ws->seq->tok);
    free(ws->seq);
    free(ws);
    *p = NULL;
}

const expert_backend *expert_workspace_backend(const expert_workspace *ws)
{
    return ws ? ws->be : NULL;
}

/* ------------------------------------------------------- kept rows -- */

/* The views of a workspace that a backward reads after the forward, in the
 * order rows are packed: for each its pointer and floats per row (the
 * kind's workspace file lists them: expert/ffnws.c, expert/seqws.c).
 * Returns the count. */
#define KEPT_MAX EXPERT__SEQ_MAX_VIEWS
_Static_assert(EXPERT__FFN_MAX_VIEWS <= KEPT_MAX, "KEPT_MAX holds every kind's kept views");
static int kept_views(const expert_workspace *ws, float *v[KEPT_MAX], size_t w[KEPT_MAX])
{
    if (ws->seq)
        return expert__seq_kept_views(&ws->cfg, &ws->be->ops, ws->seq, v, w);
    return expert__ffn_kept_views(&ws->cfg, &ws->ffn, v, w);
}

size_t expert_kept_floats(const struct expert_block_config *cfg, const expert_backend *be)
{
    if (expert_block_config_check(cfg) < 0 || !be)
        return 0;
    float *v[KEPT_MAX];
    size_t w[KEPT_MAX], sum = 0;
    int n;
    if (expert_block_kind_is_seq(cfg->kind)) {
        struct expert__seq_ws tmp;
        memset(&tmp, 0, sizeof tmp);
        n = expert__seq_kept_views(cfg, &be->ops, &tmp, v, w);
    } else {
        struct expert__ffn_ws tmp;
        memset(&tmp, 0, sizeof tmp);
        n = expert__ffn_kept_views(cfg, &tmp, v, w);
    }
    for (int i = 0; i < n; i++)
        sum += w[i];
    return sum;
}

size_t expert_workspace_kept_floats(const expert_workspace *ws)
{
    if (!ws)
        return 0;
    float *v[KEPT_MAX];
    size_t w[KEPT_MAX], sum = 0;
    int n = kept_views(ws, v, w);
    for (int i = 0; i < n; i++)
        sum += w[i];
    return sum;
}

/* Copies rows [row0, row0 + rows) between the workspace views and a packed
 * buffer of backend memory: out of the views into dst (save), or from src
 * into them (load). The views' floats are writable through a const
 * workspace: the struct holds only pointers to them. Ends with the copies
 * done, so the buffer may be used on another thread. */
static int kept_copy(const expert_workspace *ws, int row0, int rows, const float *src, float *dst)
{
    if (!ws || !(src || dst) || row0 < 0 || rows < 1 || row0 > ws->max_batch - rows)
        return -EINVAL;
    const expert_backend *be = ws->be;
    float *v[KEPT_MAX];
    size_t w[KEPT_MAX], done = 0;
    int n = kept_views(ws, v, w), rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        float *view = v[i] + (size_t)row0 * w[i];
        size_t len = (size_t)rows * w[i];
        if (dst)
            rc = be->copy(be, dst + done, view, len * sizeof(float));
        else
            rc = be->copy(be, view, src + done, len * sizeof(float));
        done += len;
    }
    return rc == 0 ? be->sync(be) : rc;
}

int expert_workspace_save_rows(const expert_workspace *ws, int row0, int rows, float *dst)
{
    return dst ? kept_copy(ws, row0, rows, NULL, dst) : -EINVAL;
}

int expert_workspace_load_rows(expert_workspace *ws, int row0, int rows, const float *src)
{
    return src ? kept_copy(ws, row0, rows, src, NULL) : -EINVAL;
}
