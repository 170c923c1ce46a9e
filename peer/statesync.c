#include "peer/statesync.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "dht/addr.h"
#include "peer/rpc_client.h"
#include "peer/service.h"
#include "peer/wire.h"

#define MAX_STATE_BYTES ((size_t)4 << 30) /* refuse absurd totals from a donor */

typedef struct sync {
    peer_rpc_client *cl;
    char block[PEER_WIRE_MAX_BLOCK + 1];
    uint64_t timeout_ms;
    peer_statesync_cb cb;
    void *arg;
    uint8_t *buf;
    size_t total, got;
    uint64_t id, version;
    int restarts;
    int status;
    int done;
} sync_t;

static void on_closed(peer_rpc_client *cl, void *arg)
{
    sync_t *s = arg;
    peer_rpc_client_destroy(&cl);
    if (s->status == 0)
        s->cb(s->arg, 0, s->buf, s->total, s->version);
    else
        s->cb(s->arg, s->status, NULL, 0, 0);
    free(s->buf);
    free(s);
}

static void finish(sync_t *s, int status)
{
    if (s->done)
        return;
    s->done = 1;
    s->status = status;
    peer_rpc_client_close(s->cl, on_closed, s);
}

static void on_reply(void *arg, int status, const peer_msg *m);

static void request(sync_t *s)
{
    uint8_t meta[16];
    peer_put_le64(meta, s->id);
    peer_put_le64(meta + 8, s->got);
    peer_msg m;
    peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_STATE, 0);
    snprintf(m.block, sizeof m.block, "%s", s->block);
    m.meta = meta;
    m.meta_len = sizeof meta;
    int rc = peer_rpc_call(s->cl, &m, s->timeout_ms, on_reply, s, NULL);
    if (rc != 0)
        finish(s, rc);
}

static void on_reply(void *arg, int status, const peer_msg *m)
{
    sync_t *s = arg;
    if (s->done)
        return;
    if (status != 0) {
        finish(s, status);
        return;
    }
    if (m->kind == PEER_KIND_ERROR) {
        if (m->err_code == ESTALE && s->restarts++ < 3) {
            s->id = 0;
            s->got = 0;
            request(s);
            return;
        }
        finish(s, m->err_code > 0 ? -m->err_code : -EIO);
        return;
    }
    /* 24 bytes; peers of session 2 sent a 4th, unused field */
    if (!m->meta || (m->meta_len != 24 && m->meta_len != 32)) {
        finish(s, -EBADMSG);
        return;
    }
    uint64_t id = peer_get_le64(m->meta), total = peer_get_le64((const uint8_t *)m->meta + 8);
    uint64_t version = peer_get_le64((const uint8_t *)m->meta + 16);
    if (s->id == 0) {
        /* The first chunk fixes the snapshot and its size. */
        if (total == 0 || total > MAX_STATE_BYTES) {
            finish(s, -EBADMSG);
            return;
        }
        uint8_t *buf = realloc(s->buf, total);
        if (!buf) {
            finish(s, -ENOMEM);
            return;
        }
        s->buf = buf;
        s->id = id;
        s->total = total;
        s->version = version;
    } else if (id != s->id || total != s->total) {
        finish(s, -EBADMSG);
        return;
    }
    size_t want = s->total - s->got < PEER_STATE_CHUNK ? s->total - s->got : PEER_STATE_CHUNK;
    if (m->n_tensors != 1 || m->t[0].dtype != PEER_DTYPE_F32 || m->t[0].nbytes < want ||
        m->t[0].nbytes > want + 3) {
        finish(s, -EBADMSG);
        return;
    }
    memcpy(s->buf + s->got, m->t[0].data, want);
    s->got += want;
    if (s->got == s->total)
        finish(s, 0);
    else
        request(s);
}

static void on_connect(peer_rpc_client *cl, int status, void *arg)
{
    (void)cl;
    sync_t *s = arg;
    if (status != 0)
        finish(s, status);
    else
        request(s);
}

int peer_statesync_start(uv_loop_t *loop, const dht_identity *self, const uint8_t *swarm_key,
                         const uint8_t donor_id[DHT_ID_LEN], const char *donor_addr, const char *block,
                         double timeout_s, peer_statesync_cb cb, void *arg)
{
    dht_addr a;
    struct sockaddr_storage ss;
    if (!loop || !self || !donor_id || !donor_addr || !block || !cb ||
        strlen(block) > PEER_WIRE_MAX_BLOCK || dht_addr_parse(&a, donor_addr) != 0 ||
        dht_addr_to_sockaddr(&a, &ss) < 0)
        return -EINVAL;
    sync_t *s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    snprintf(s->block, sizeof s->block, "%s", block);
    s->timeout_ms = (uint64_t)(timeout_s * 1000);
    s->cb = cb;
    s->arg = arg;
    peer_rpc_client_config cc;
    memset(&cc, 0, sizeof cc);
    cc.self = self;
    cc.expect_id = donor_id;
    cc.swarm_key = swarm_key;
    cc.max_pending = 4;
    s->cl = peer_rpc_client_create(loop, &cc);
    if (!s->cl) {
        free(s);
        return -ENOMEM;
    }
    int rc = peer_rpc_client_connect(s->cl, (const struct sockaddr *)&ss, on_connect, s);
    if (rc != 0) {
        peer_rpc_client_destroy(&s->cl);
        free(s);
        return rc;
    }
    return 0;
}

/* ---- Trust ---- */

#define TRUST_MAX_CLAIMS 256

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

uint64_t peer_trust_median_u64(const uint64_t *v, int n, int skip)
{
    uint64_t s[TRUST_MAX_CLAIMS];
    int m = 0;
    for (int i = 0; v && i < n && i < TRUST_MAX_CLAIMS; i++)
        if (i != skip && v[i] > 0)
            s[m++] = v[i];
    if (m == 0)
        return 0;
    qsort(s, (size_t)m, sizeof s[0], cmp_u64);
    return s[m / 2];
}

double peer_trust_median(const double *v, int n, int skip)
{
    double s[TRUST_MAX_CLAIMS];
    int m = 0;
    for (int i = 0; v && i < n && i < TRUST_MAX_CLAIMS; i++)
        if (i != skip && v[i] > 0 && isfinite(v[i]))
            s[m++] = v[i];
    if (m == 0)
        return 0;
    qsort(s, (size_t)m, sizeof s[0], cmp_double);
    return s[m / 2];
}

/* a * f + b without wrapping around. */
static uint64_t sat_mul_add(uint64_t a, uint64_t f, uint64_t b)
{
    if (f && a > (UINT64_MAX - b) / f)
        return UINT64_MAX;
    return a * f + b;
}

int peer_trust_version_suspect(const uint64_t *version, int n, int i)
{
    if (!version || i < 0 || i >= n)
        return 0;
    uint64_t med = peer_trust_median_u64(version, n, i);
    if (med == 0)
        return 0; /* nothing to compare with */
    return version[i] > sat_mul_add(med, PEER_TRUST_VERSION_FACTOR, PEER_TRUST_VERSION_SLACK);
}

int peer_trust_tput_suspect(const double *tput, int n, int i)
{
    if (!tput || i < 0 || i >= n || !(tput[i] > 0))
        return 0;
    double med = peer_trust_median(tput, n, i);
    if (med <= 0)
        return 0;
    return !isfinite(tput[i]) || tput[i] > PEER_TRUST_TPUT_FACTOR * med;
}

uint64_t peer_statesync_choose(const uint64_t *version, int n, uint8_t *suspect)
{
    uint64_t top = 0;
    for (int i = 0; version && i < n; i++) {
        int bad = peer_trust_version_suspect(version, n, i);
        if (suspect)
            suspect[i] = (uint8_t)bad;
        if (!bad && version[i] > top)
            top = version[i];
    }
    /* Every trusted claim is 0 (a young swarm: announcements lag the
     * holders' first steps by up to the announcement period): no claim to
     * bound the download by. */
    if (top == 0)
        return UINT64_MAX;
    return sat_mul_add(top, PEER_TRUST_VERSION_FACTOR, PEER_TRUST_VERSION_SLACK);
}
