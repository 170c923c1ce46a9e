/* expert/atomicfile.c: files written whole or not at all (atomicfile.h). */
#include "expert/atomicfile.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

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

int expert_atomic_open(expert_atomic_file *f, const char *path)
{
    f->fd = -1;
    f->rc = 0;
    if (!path || !*path)
        return -EINVAL;
    if (strlen(path) >= sizeof f->path ||
        snprintf(f->tmp, sizeof f->tmp, "%s.tmp.%ld.XXXXXX", path, (long)getpid()) >= (int)sizeof f->tmp)
        return -ENAMETOOLONG;
    strcpy(f->path, path);
    /* The pid in the name and the lock held until the rename let
     * expert_ckpt_clean_tmp tell a killed writer's file from a live one. */
    f->fd = mkostemp(f->tmp, O_CLOEXEC);
    if (f->fd < 0)
        return -errno;
    /* Best effort: a file system without flock still has the pid test. */
    (void)flock(f->fd, LOCK_EX | LOCK_NB);
    return 0;
}

int expert_atomic_write(expert_atomic_file *f, const void *buf, size_t len)
{
    const char *p = buf;
    while (f->rc == 0 && len > 0) {
        ssize_t n = write(f->fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            f->rc = n < 0 ? -errno : -EIO;
            break;
        }
        p += n;
        len -= (size_t)n;
    }
    return f->rc;
}

int expert_atomic_commit(expert_atomic_file *f)
{
    int rc = f->fd < 0 ? -EBADF : f->rc;
    if (rc == 0 && fchmod(f->fd, 0644) < 0)
        rc = -errno;
    /* fsync before rename: otherwise the rename can reach the disk before
     * the data and a crash leaves an empty or torn file under path. */
    if (rc == 0 && fsync(f->fd) < 0)
        rc = -errno;
    if (rc == 0 && rename(f->tmp, f->path) < 0)
        rc = -errno;
    if (rc < 0 && f->fd >= 0)
        unlink(f->tmp);
    /* Closing releases the lock, after the temp name is gone. */
    if (f->fd >= 0 && close(f->fd) < 0 && rc == 0)
        rc = -errno;
    f->fd = -1;
    /* And the directory, so the rename itself is durable. */
    return rc < 0 ? rc : fsync_dir_of(f->path);
}

void expert_atomic_abort(expert_atomic_file *f)
{
    if (f->fd < 0)
        return;
    unlink(f->tmp);
    close(f->fd);
    f->fd = -1;
}
