/* expert/checkpoint.c: checkpoint files (the bytes of expert_block_serialize)
 * written atomically: temp file in the same directory, fsync, rename, fsync
 * of the directory. */
#include "expert/block.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int fsync_dir_of(const char *path)
{
    char tmp[PATH_MAX];
    if (strlen(path) >= sizeof tmp)
        return -ENAMETOOLONG;
    strcpy(tmp, path);
    int fd = open(dirname(tmp), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = fsync(fd) < 0 ? -errno : 0;
    close(fd);
    return rc;
}

int expert_block_save(expert_block *b, const char *path, int with_optim)
{
    if (!b || !path || !*path)
        return -EINVAL;
    size_t len = expert_block_serialized_size(b, with_optim);
    void *buf = malloc(len);
    if (!buf)
        return -ENOMEM;
    long n = expert_block_serialize(b, with_optim, buf, len);
    if (n < 0) {
        free(buf);
        return (int)n;
    }
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.XXXXXX", path) >= (int)sizeof tmp) {
        free(buf);
        return -ENAMETOOLONG;
    }
    int fd = mkstemp(tmp);
    if (fd < 0) {
        int e = -errno;
        free(buf);
        return e;
    }
    int rc = write_all(fd, buf, (size_t)n);
    free(buf);
    if (rc == 0 && fchmod(fd, 0644) < 0)
        rc = -errno;
    /* fsync before rename: otherwise the rename can reach the disk before
     * the data and a crash leaves an empty or torn file under path. */
    if (rc == 0 && fsync(fd) < 0)
        rc = -errno;
    if (close(fd) < 0 && rc == 0)
        rc = -errno;
    if (rc == 0 && rename(tmp, path) < 0)
        rc = -errno;
    if (rc < 0) {
        unlink(tmp);
        return rc;
    }
    /* And the directory, so the rename itself is durable. */
    return fsync_dir_of(path);
}

int expert_block_load(expert_block *b, const char *path)
{
    if (!b || !path)
        return -EINVAL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    /* Only the two sizes a checkpoint of this block can have are read; a
     * truncated, padded or foreign file is refused before any allocation. */
    size_t size = (size_t)st.st_size;
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return -EBADMSG;
    }
    if (size != expert_block_serialized_size(b, 0) &&
        size != expert_block_serialized_size(b, 1)) {
        /* Say "another block's checkpoint" when the header shows it, so the
         * operator sees a mismatch rather than corruption. */
        unsigned char hdr[64];
        int rc = -EBADMSG;
        if (size >= sizeof hdr && pread(fd, hdr, sizeof hdr, 0) == (ssize_t)sizeof hdr &&
            expert_block_header_mismatch(b, hdr, sizeof hdr))
            rc = -ESTALE;
        close(fd);
        return rc;
    }
    char *buf = malloc(size);
    if (!buf) {
        close(fd);
        return -ENOMEM;
    }
    size_t got = 0;
    int rc = 0;
    while (got < size) {
        ssize_t n = read(fd, buf + got, size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            rc = -errno;
            break;
        }
        if (n == 0) {
            rc = -EBADMSG; /* shrank while we read */
            break;
        }
        got += (size_t)n;
    }
    close(fd);
    if (rc == 0)
        rc = expert_block_deserialize(b, buf, size);
    free(buf);
    return rc;
}
