/* peer/device.h: where a peer runs its blocks (--device, --precision):
 * parsing and checking the flags, and opening the backend the blocks are
 * created on (expert/backend.h).
 *
 * Devices: "cpu"; "cuda" (= cuda:0) or "cuda:N", an NVIDIA GPU; "auto",
 * the first GPU when this build has CUDA and the machine a usable GPU,
 * else the CPU; and "sim" or "sim:MiB", the simulated device (the CPU's
 * math behind device memory with a budget of MiB, for tests of the GPU
 * paths on machines without one). Precisions: fp32 everywhere, bf16 on a
 * GPU (its default there). */
#ifndef PEER_DEVICE_H
#define PEER_DEVICE_H

#include <stddef.h>

#include "expert/backend.h"

typedef enum peer_device_kind {
    PEER_DEVICE_CPU = 0,
    PEER_DEVICE_CUDA = 1,
    PEER_DEVICE_SIM = 2,
} peer_device_kind;

typedef struct peer_device {
    peer_device_kind kind;
    int index;          /* CUDA device index; 0 otherwise */
    size_t sim_bytes;   /* sim: the memory budget (0: none) */
    char name[33];      /* what announcements carry: "cpu", "cuda:0", "sim" */
    char desc[160];     /* for people, e.g. "cpu (OpenBLAS Haswell, 2 threads)" or
                           "cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB, sm_90)" */
} peer_device;

/* Parses and checks a --device value. Checks that the device exists in
 * this build on this machine. Returns 0 and fills out, or -EINVAL
 * (malformed), -ENOSYS (no CUDA in this build) or -ENODEV (no such GPU);
 * on failure err (if not NULL) receives a sentence for the user. */
int peer_device_parse(const char *spec, peer_device *out, char *err, size_t errlen);

/* The precision for --precision NAME on device d (NULL: the device's
 * default, bf16 on a GPU, else fp32). Returns it, or -EINVAL with a
 * sentence in err (an unknown name, or bf16 off a GPU). */
int peer_device_precision(const peer_device *d, const char *name, char *err, size_t errlen);

/* Opens d's backend at precision (peer_device_precision). The backend
 * lives until peer_device_close (the CPU's and CUDA's for the process's
 * life). Returns 0, or -errno with a sentence in err. */
int peer_device_open(const peer_device *d, int precision, const expert_backend **be_out, char *err,
                     size_t errlen);
/* Releases what peer_device_open made (a simulated device); call it after
 * every block on it is gone. */
void peer_device_close(void);

/* "1.5 GiB", "300 MiB": bytes for messages. Returns buf. */
const char *peer_device_bytes(char *buf, size_t len, size_t bytes);

#endif
