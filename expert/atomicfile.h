/* expert/atomicfile.h: a file written whole or not at all: into a
 * temporary file beside the target ("PATH.tmp.PID.XXXXXX", locked while it
 * is written), fsync, rename over the target, fsync of the directory. A
 * write that fails at any step leaves the earlier file in place and no
 * temporary behind. Checkpoints, safetensors and token files use it;
 * expert_ckpt_clean_tmp removes the temporaries of writers that were
 * killed. One handle belongs to one thread.
 */
#ifndef EXPERT_ATOMICFILE_H
#define EXPERT_ATOMICFILE_H

#include <limits.h>
#include <stddef.h>

typedef struct expert_atomic_file {
    int fd;                   /* the temporary file, -1 when closed */
    int rc;                   /* the first error (sticky), or 0 */
    char tmp[PATH_MAX];
    char path[PATH_MAX];
} expert_atomic_file;

/* Starts writing path. Returns 0, or -errno (-ENAMETOOLONG, the temporary
 * file's creation) with nothing to undo. */
int expert_atomic_open(expert_atomic_file *f, const char *path);

/* Appends len bytes. Returns 0 or the first error so far (-errno); after an
 * error later writes do nothing and commit fails with it. */
int expert_atomic_write(expert_atomic_file *f, const void *buf, size_t len);

/* Makes the file mode 0644, syncs it, renames it over the target and syncs
 * the directory. Returns 0, or the first -errno (the temporary file is then
 * removed and the target untouched). Closes f either way. */
int expert_atomic_commit(expert_atomic_file *f);

/* Gives up: removes the temporary file and closes f. */
void expert_atomic_abort(expert_atomic_file *f);

#endif
