/* peer/device.h: where a peer runs its blocks (--device cpu | cuda:N). */
#ifndef PEER_DEVICE_H
#define PEER_DEVICE_H

#include <stddef.h>

typedef enum peer_device_kind { PEER_DEVICE_CPU = 0, PEER_DEVICE_CUDA = 1 } peer_device_kind;

typedef struct peer_device {
    peer_device_kind kind;
    int index;          /* CUDA device index; 0 for the CPU */
    char desc[128];     /* human-readable, e.g. "cpu (OpenBLAS Haswell, 2 threads)" */
} peer_device;

/* Parses and checks a --device value: "cpu", "cuda" (= cuda:0) or "cuda:N".
 * Checks that the device exists in this build on this machine.
 * Returns 0 and fills out, or -EINVAL (malformed), -ENOSYS (no CUDA in this
 * build) or -ENODEV (no such GPU); on failure err (if not NULL) receives a
 * sentence for the user. */
int peer_device_parse(const char *spec, peer_device *out, char *err, size_t errlen);

#endif
