#include "dht/identity.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

/* "magic" SP 64 hex SP 64 hex LF */
#define IDENT_LINE_LEN (sizeof(DHT_IDENTITY_MAGIC) - 1 + 1 + 64 + 1 + 64 + 1)

int dht_crypto_init(void)
{
    /* sodium_init returns 1 when already initialised. */
    return sodium_init() < 0 ? -EIO : 0;
}

static void identity_finish(dht_identity *out)
{
    dht_id_of_pubkey(out->id, out->pk);
}

int dht_identity_generate(dht_identity *out)
{
    if (!out)
        return -EINVAL;
    if (dht_crypto_init() != 0)
        return -EIO;
    crypto_sign_keypair(out->pk, out->sk);
    identity_finish(out);
    return 0;
}

int dht_identity_from_seed(dht_identity *out, const uint8_t seed[32])
{
    if (!out || !seed)
        return -EINVAL;
    if (dht_crypto_init() != 0)
        return -EIO;
    crypto_sign_seed_keypair(out->pk, out->sk, seed);
    identity_finish(out);
    return 0;
}

static int write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Makes a rename/link durable by syncing the directory that holds path. */
static void fsync_parent_dir(const char *path)
{
    char copy[PATH_MAX];
    if (snprintf(copy, sizeof copy, "%s", path) >= (int)sizeof copy)
        return;
    int dfd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        (void)fsync(dfd);
        close(dfd);
    }
}

int dht_identity_save(const dht_identity *ident, const char *path, int overwrite)
{
    char line[IDENT_LINE_LEN + 1];
    char tmp[PATH_MAX];
    int rc;

    if (!ident || !path || !*path)
        return -EINVAL;
    if (dht_crypto_init() != 0)
        return -EIO;
    if (snprintf(tmp, sizeof tmp, "%s.tmp.XXXXXX", path) >= (int)sizeof tmp)
        return -ENAMETOOLONG;

    /* Layout: magic, seed (first half of libsodium's sk), public key. */
    size_t off = (size_t)snprintf(line, sizeof line, "%s ", DHT_IDENTITY_MAGIC);
    sodium_bin2hex(line + off, 65, ident->sk, 32);
    off += 64;
    line[off++] = ' ';
    sodium_bin2hex(line + off, 65, ident->pk, 32);
    off += 64;
    line[off++] = '\n';
    line[off] = '\0';

    int fd = mkstemp(tmp); /* creates the file with mode 0600 */
    if (fd < 0) {
        rc = -errno;
        sodium_memzero(line, sizeof line);
        return rc;
    }
    rc = write_all(fd, line, off);
    sodium_memzero(line, sizeof line);
    if (rc == 0 && fchmod(fd, 0600) != 0)
        rc = -errno;
    if (rc == 0 && fsync(fd) != 0)
        rc = -errno;
    if (close(fd) != 0 && rc == 0)
        rc = -errno;
    if (rc == 0) {
        /* link() fails with EEXIST atomically, so two concurrent keygens can
         * never both believe they wrote the file. */
        if (overwrite ? rename(tmp, path) != 0 : link(tmp, path) != 0)
            rc = -errno;
    }
    if (rc != 0 || !overwrite)
        (void)unlink(tmp);
    if (rc == 0)
        fsync_parent_dir(path);
    return rc;
}

int dht_identity_load(dht_identity *out, const char *path)
{
    char buf[IDENT_LINE_LEN + 2];
    uint8_t seed[32], pk[32];
    size_t seed_len = 0, pk_len = 0;
    const char *end = NULL;
    struct stat st;
    ssize_t got;
    size_t len = 0;
    int rc = 0;

    if (!out)
        return -EINVAL;
    memset(out, 0, sizeof *out);
    if (!path || !*path)
        return -EINVAL;
    if (dht_crypto_init() != 0)
        return -EIO;

    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return errno == ELOOP ? -EBADMSG : -errno;
    if (fstat(fd, &st) != 0) {
        rc = -errno;
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = -EBADMSG;
        goto out;
    }
    if (st.st_mode & (S_IRWXG | S_IRWXO)) {
        rc = -EPERM;
        goto out;
    }
    /* Read one byte more than a valid file holds to detect trailing junk. */
    while (len < sizeof buf - 1) {
        got = read(fd, buf + len, sizeof buf - 1 - len);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            rc = -errno;
            goto out;
        }
        if (got == 0)
            break;
        len += (size_t)got;
    }
    buf[len] = '\0';

    const size_t mlen = sizeof(DHT_IDENTITY_MAGIC) - 1;
    if (len != IDENT_LINE_LEN || memcmp(buf, DHT_IDENTITY_MAGIC, mlen) != 0 ||
        buf[mlen] != ' ' || buf[mlen + 65] != ' ' || buf[IDENT_LINE_LEN - 1] != '\n') {
        rc = -EBADMSG;
        goto out;
    }
    if (sodium_hex2bin(seed, sizeof seed, buf + mlen + 1, 64, NULL, &seed_len, &end) != 0 ||
        seed_len != 32 || end != buf + mlen + 65 ||
        sodium_hex2bin(pk, sizeof pk, buf + mlen + 66, 64, NULL, &pk_len, &end) != 0 ||
        pk_len != 32 || end != buf + IDENT_LINE_LEN - 1) {
        rc = -EBADMSG;
        goto out;
    }
    crypto_sign_seed_keypair(out->pk, out->sk, seed);
    if (sodium_memcmp(out->pk, pk, sizeof pk) != 0) {
        rc = -EBADMSG;
        goto out;
    }
    identity_finish(out);

out:
    sodium_memzero(buf, sizeof buf);
    sodium_memzero(seed, sizeof seed);
    if (rc != 0)
        sodium_memzero(out, sizeof *out);
    close(fd);
    return rc;
}

const char *dht_identity_strerror(int err)
{
    switch (err) {
    case 0: return "success";
    case -ENOENT: return "no such file";
    case -EEXIST: return "the file already exists (use --force to replace it)";
    case -EPERM: return "the key file is readable by group or others; run chmod 600 on it";
    case -EBADMSG: return "not a valid Starling identity file (corrupt or truncated)";
    case -EACCES: return "permission denied";
    case -EINVAL: return "invalid argument";
    case -EIO: return "the crypto library failed to initialise";
    default: return strerror(-err);
    }
}
