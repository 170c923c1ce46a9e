#include "expert/blas.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cblas.h>

int expert_blas_set_threads(int n)
{
    if (n <= 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        n = cpus > 0 ? (int)cpus : 1;
    }
    openblas_set_num_threads(n);
    return openblas_get_num_threads();
}

int expert_blas_threads(void)
{
    return openblas_get_num_threads();
}

const char *expert_blas_corename(void)
{
    const char *s = openblas_get_corename();
    return s ? s : "unknown";
}

void expert_blas_prefer_native(char **argv)
{
    const char *want = getenv("STARLING_BLAS_CORETYPE");
    const char *have = getenv("OPENBLAS_CORETYPE");

    if (getenv("STARLING_BLAS_REEXECED")) {
        /* Second run: done. Drop the marker so our own children decide afresh. */
        unsetenv("STARLING_BLAS_REEXECED");
        return;
    }
    if (want && strcmp(want, "env") == 0)
        return;
    if (want && *want) {
        if (have && strcmp(have, want) == 0)
            return;
        setenv("OPENBLAS_CORETYPE", want, 1);
    } else {
        if (!have)
            return;
        unsetenv("OPENBLAS_CORETYPE");
    }
    setenv("STARLING_BLAS_REEXECED", "1", 1);
    /* By the binary's real path where it resolves, so the process (and the
     * threads OpenBLAS starts as it loads, before a command names itself)
     * shows as "starling" in ps/top, not as "exe". */
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = '\0';
        execv(self, argv);
    }
    execv("/proc/self/exe", argv);
    /* exec failed: carry on with the kernels already loaded. */
    if (have)
        setenv("OPENBLAS_CORETYPE", have, 1);
}
