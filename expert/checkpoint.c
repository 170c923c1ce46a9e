/* expert/checkpoint.c: checkpoint files (the bytes of expert_block_serialize,
 * expert/serialize.c) written atomically: temp file in the same directory,
 * fsync, rename, fsync of the directory; loading with a sentence that says
 * what is wrong; and removing the temp files of writers that were killed. */
#include "expert/atomicfile.h"
#include "expert/block.h"
#include "expert/model.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int expert_block_save(expert_block *b, const char *path, int with_optim)
{
    if (!b || !path || !*path)
        return -EINVAL;
    /* The size can grow between the two calls (an averaging round gives
     * the block its outer state): then size it again. */
    void *buf = NULL;
    long n = -ENOSPC;
    for (int tries = 0; tries < 3 && n == -ENOSPC; tries++) {
        size_t len = expert_block_serialized_size(b, with_optim);
        free(buf);
        if (!(buf = malloc(len)))
            return -ENOMEM;
        n = expert_block_serialize(b, with_optim, buf, len);
    }
    if (n < 0) {
        free(buf);
        return (int)n;
    }
    expert_atomic_file f;
    int rc = expert_atomic_open(&f, path);
    if (rc == 0) {
        expert_atomic_write(&f, buf, (size_t)n);
        rc = expert_atomic_commit(&f);
    }
    free(buf);
    return rc;
}

static void say(char *msg, size_t msglen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void say(char *msg, size_t msglen, const char *fmt, ...)
{
    if (!msg || !msglen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, msglen, fmt, ap);
    va_end(ap);
}

/* "fmnist-mlp.2 (stage hash 1a2b...)" or what an unnamed state holds. */
static void describe_file(char *out, size_t len, const struct expert_ckpt_info *h)
{
    if (h->stage[0])
        snprintf(out, len, "%s (stage hash %016" PRIx64 ")", h->stage, h->stage_hash);
    else
        snprintf(out, len, "a block of config %016" PRIx64 " (kind %d, %d -> %d, hidden %d) that names no stage",
                 h->config_hash, h->cfg.kind, h->cfg.in, h->cfg.out, h->cfg.hidden);
}

static void describe_block(char *out, size_t len, const expert_block *b)
{
    uint64_t sh;
    const char *stage = expert_block_stage(b, &sh);
    const struct expert_block_config *c = expert_block_config(b);
    if (stage[0])
        snprintf(out, len, "%s (stage hash %016" PRIx64 ")", stage, sh);
    else
        snprintf(out, len, "a block of config %016" PRIx64 " (kind %d, %d -> %d, hidden %d)",
                 expert_block_config_hash(c), c->kind, c->in, c->out, c->hidden);
}

static void say_stale(char *msg, size_t msglen, const char *path, const expert_block *b,
                      const struct expert_ckpt_info *h)
{
    char f[256], w[256];
    describe_file(f, sizeof f, h);
    describe_block(w, sizeof w, b);
    say(msg, msglen, "%s holds %s, not %s", path, f, w);
}

int expert_block_load(expert_block *b, const char *path, char *msg, size_t msglen)
{
    if (msg && msglen)
        msg[0] = '\0';
    if (!b || !path)
        return -EINVAL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = -errno;
        say(msg, msglen, "cannot open %s: %s", path, strerror(-e));
        return e;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) {
        int e = -errno;
        close(fd);
        say(msg, msglen, "cannot read %s: %s", path, strerror(-e));
        return e;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        say(msg, msglen, "%s is not a regular file", path);
        return -EBADMSG;
    }
    /* The header first: another block's or stage's file is named as such,
     * and only the one size the header implies is ever read. */
    uint8_t hdr[512];
    ssize_t got = pread(fd, hdr, sizeof hdr, 0);
    struct expert_ckpt_info h;
    int rc = expert_ckpt_peek(hdr, got > 0 ? (size_t)got : 0, &h);
    if (rc == -EPROTONOSUPPORT) {
        close(fd);
        say(msg, msglen, "%s is checkpoint format %" PRIu32 "; this build reads formats 1 to %d", path,
            h.format, EXPERT_CKPT_FORMAT);
        return rc;
    }
    if (rc == 0 && expert_block_ckpt_fits(b, &h) != 0) {
        close(fd);
        say_stale(msg, msglen, path, b, &h);
        return -ESTALE;
    }
    size_t size = (size_t)st.st_size;
    if (rc != 0 || size != h.total_len) {
        close(fd);
        if (rc != 0)
            say(msg, msglen, "%s is corrupt: not a checkpoint header", path);
        else
            say(msg, msglen, "%s is truncated or padded: %zu bytes, its header implies %zu", path, size,
                h.total_len);
        return -EBADMSG;
    }
    char *buf = malloc(size);
    if (!buf) {
        close(fd);
        say(msg, msglen, "out of memory reading %s", path);
        return -ENOMEM;
    }
    size_t have = 0;
    while (have < size) {
        ssize_t n = read(fd, buf + have, size - have);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            rc = -errno;
            say(msg, msglen, "cannot read %s: %s", path, strerror(errno));
            break;
        }
        if (n == 0) {
            rc = -EBADMSG; /* shrank while we read */
            say(msg, msglen, "%s shrank while it was read", path);
            break;
        }
        have += (size_t)n;
    }
    close(fd);
    if (rc == 0) {
        rc = expert_block_deserialize(b, buf, size);
        if (rc == -EBADMSG)
            say(msg, msglen, "%s is corrupt: its checksum or contents do not verify", path);
        else if (rc == -ESTALE)
            say_stale(msg, msglen, path, b, &h);
        else if (rc != 0)
            say(msg, msglen, "cannot load %s: %s", path, strerror(-rc));
    }
    free(buf);
    const char *stage = expert_block_stage(b, NULL);
    if (rc == 0 && stage[0] && !h.stage[0])
        say(msg, msglen,
            "%s records no stage (checkpoint format %" PRIu32 "): loaded into %s because its block config "
            "%016" PRIx64 " matches, but it may be another stage's file of the same shape",
            path, h.format, stage, h.config_hash);
    return rc;
}

/* ------------------------------------------------- stale temp files -- */

/* The part of a temp name after "<basename>.tmp.": "<pid>.XXXXXX" (*pid_out
 * set) or an older build's "XXXXXX" (*pid_out = 0); mkstemp's six letters
 * are [A-Za-z0-9]. -1 for anything else. */
static int parse_tmp_suffix(const char *s, long *pid_out)
{
    const char *dot = strchr(s, '.');
    const char *x = s;
    *pid_out = 0;
    if (dot) {
        if (dot == s || (s[0] == '0') || dot - s > 10)
            return -1;
        long pid = 0;
        for (const char *c = s; c < dot; c++) {
            if (*c < '0' || *c > '9')
                return -1;
            pid = pid * 10 + (*c - '0');
        }
        if (pid <= 0 || pid > INT_MAX)
            return -1;
        *pid_out = pid;
        x = dot + 1;
    }
    if (strlen(x) != 6)
        return -1;
    for (; *x; x++)
        if (!((*x >= 'A' && *x <= 'Z') || (*x >= 'a' && *x <= 'z') || (*x >= '0' && *x <= '9')))
            return -1;
    return 0;
}

int expert_ckpt_clean_tmp(const char *path, uint64_t *bytes_out)
{
    if (bytes_out)
        *bytes_out = 0;
    if (!path || !*path)
        return -EINVAL;
    char dbuf[PATH_MAX], bbuf[PATH_MAX];
    if (strlen(path) >= sizeof dbuf)
        return -ENAMETOOLONG;
    strcpy(dbuf, path);
    strcpy(bbuf, path);
    const char *dir = dirname(dbuf), *base = basename(bbuf);
    char prefix[NAME_MAX + 8];
    if (snprintf(prefix, sizeof prefix, "%s.tmp.", base) >= (int)sizeof prefix)
        return -ENAMETOOLONG;
    size_t pl = strlen(prefix);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0)
        return -errno;
    DIR *d = fdopendir(dfd);
    if (!d) {
        int e = -errno;
        close(dfd);
        return e;
    }
    long self = (long)getpid();
    time_t now = time(NULL);
    int removed = 0;
    uint64_t bytes = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        long pid;
        if (strncmp(e->d_name, prefix, pl) != 0 || parse_tmp_suffix(e->d_name + pl, &pid) != 0)
            continue;
        int fd = openat(dfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0)
            continue;
        struct stat st;
        if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
            close(fd);
            continue;
        }
        int lock = flock(fd, LOCK_EX | LOCK_NB) == 0 ? 0 : errno == EWOULDBLOCK ? 1 : -1;
        int old = now - st.st_mtime >= EXPERT_CKPT_TMP_STALE_S;
        int gone = pid && (pid == self || (kill((pid_t)pid, 0) < 0 && errno == ESRCH));
        /* Locked: a write in flight. Without a pid (an older build, which
         * took no lock) only age says the file is abandoned; with a live
         * pid, the lock free and age; where flock is unsupported, a dead pid
         * and age together. */
        int stale = lock == 1 ? 0 : !pid ? old : lock == 0 ? (gone || old) : (gone && old);
        if (stale && unlinkat(dfd, e->d_name, 0) == 0) {
            removed++;
            bytes += (uint64_t)st.st_size;
        }
        close(fd); /* after the unlink: nobody can take the name's lock meanwhile */
    }
    closedir(d);
    if (bytes_out)
        *bytes_out = bytes;
    return removed;
}

int expert_block_load_flat(expert_block *b, const struct expert_model_spec *m, int index,
                           const char *path, char *msg, size_t msglen)
{
    if (msg && msglen)
        msg[0] = '\0';
    struct expert_block_config c;
    if (!b || !path || expert_model_stage(m, index, &c) != 0 ||
        memcmp(&c, expert_block_config(b), sizeof c) != 0)
        return -EINVAL;
    /* Where the stage's slice starts, and the model's whole size. */
    size_t before = 0, total = 0, n = expert_block_nparams(b);
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config cs;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        size_t ns = 0;
        expert_model_stage(m, s, &cs);
        expert_block_config_tensors(&cs, t, &ns);
        if (s < index)
            before += ns;
        total += ns;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = -errno;
        say(msg, msglen, "cannot open %s: %s", path, strerror(-e));
        return e;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != (uint64_t)total * 4) {
        close(fd);
        say(msg, msglen, "%s is not a flat weight file of %s: it must hold exactly %zu float32 values "
                         "(%zu bytes)", path, m->name, total, total * 4);
        return -EBADMSG;
    }
    float *p = malloc(n * sizeof *p);
    if (!p) {
        close(fd);
        say(msg, msglen, "out of memory reading %s", path);
        return -ENOMEM;
    }
    size_t done = 0;
    while (done < n * sizeof *p) {
        ssize_t got = pread(fd, (char *)p + done, n * sizeof *p - done, (off_t)(before * 4 + done));
        if (got <= 0) {
            int e = got < 0 ? -errno : -EBADMSG;
            free(p);
            close(fd);
            say(msg, msglen, "cannot read %s: %s", path, got < 0 ? strerror(-e) : "short read");
            return e;
        }
        done += (size_t)got;
    }
    close(fd);
    for (size_t i = 0; i < n; i++)
        if (!isfinite(p[i])) {
            free(p);
            say(msg, msglen, "%s: value %zu of stage %s.%d is not finite", path, i, m->name, index);
            return -EBADMSG;
        }
    int rc = expert_block_set_params(b, p);
    free(p);
    return rc;
}
