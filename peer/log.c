#include "peer/log.h"

#include <stdarg.h>

void peer_log(FILE *f, const char *fmt, ...)
{
    if (!f)
        f = stderr;
    va_list ap;
    va_start(ap, fmt);
    flockfile(f); /* one whole line even when several threads log */
    fprintf(f, "starling peer: ");
    vfprintf(f, fmt, ap);
    fputc('\n', f);
    fflush(f);
    funlockfile(f);
    va_end(ap);
}
