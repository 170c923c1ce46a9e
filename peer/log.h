/* peer/log.h: the daemon's status lines ("starling peer: ..."), one line
 * per call, flushed at once (operators follow them with tail -f). Any
 * thread: a line is written whole. */
#ifndef PEER_LOG_H
#define PEER_LOG_H

#include <stdio.h>

/* Writes "starling peer: " + the formatted text + newline to f (stderr
 * when NULL) and flushes. */
void peer_log(FILE *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
