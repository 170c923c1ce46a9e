/* expert/safetensors.h: weight files in the safetensors format, read and
 * written (the format Hugging Face and train_llama.py exchange weights in).
 *
 * A file is: 8 bytes N (u64 little-endian); N bytes of UTF-8 JSON, an
 * object whose keys are tensor names (each {"dtype", "shape",
 * "data_offsets": [begin, end]}) and optionally "__metadata__" (an object
 * of strings); then the data, each tensor's bytes little-endian in C order
 * at [begin, end) counted from the first byte after the header.
 *
 * Reading is strict, as the reference implementation is: a header length
 * past the file or over EXPERT_ST_MAX_HEADER, bytes that are not one JSON
 * object (or repeat a key), an entry without dtype, shape or data_offsets
 * or with values of the wrong type, a dtype other than F32, F16, BF16 or
 * F64 (the float formats; others are named in the error), more than
 * EXPERT_ST_MAX_DIMS dimensions, offsets that do not match the shape, run
 * past the data, overlap, or leave a hole, are each refused with one
 * sentence naming the file and the tensor. Opening reads and checks only
 * the header; a tensor's bytes are read when asked for (a peer reads only
 * its own stages' tensors from a whole model's file), converted to f32.
 *
 * Writing produces F32 tensors in the order given, the metadata first, the
 * header compact and padded with spaces to a multiple of 8 (as
 * train_llama.py writes it), into a temporary file renamed over the target
 * once complete: a failed write leaves any earlier file in place.
 *
 * Thread-safety: a file handle belongs to one thread at a time; the
 * functions share no state.
 */
#ifndef EXPERT_SAFETENSORS_H
#define EXPERT_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define EXPERT_ST_MAX_HEADER (100u << 20)  /* bytes of JSON header accepted */
#define EXPERT_ST_MAX_DIMS 8
#define EXPERT_ST_MAX_TENSORS (1 << 20)
#define EXPERT_ST_NAME_MAX 255

typedef enum expert_st_dtype {
    EXPERT_ST_F32 = 0,
    EXPERT_ST_F16 = 1,
    EXPERT_ST_BF16 = 2,
    EXPERT_ST_F64 = 3,
} expert_st_dtype;

/* One tensor's header entry. */
typedef struct expert_st_tensor {
    const char *name;              /* owned by the file handle */
    expert_st_dtype dtype;
    int ndim;                      /* 0 (a scalar) .. EXPERT_ST_MAX_DIMS */
    uint64_t shape[EXPERT_ST_MAX_DIMS];
    uint64_t count;                /* elements: the product of shape */
    uint64_t begin, end;           /* bytes, from the first byte after the header */
} expert_st_tensor;

typedef struct expert_st_file expert_st_file;

/* Opens path and checks its header (see above). Returns 0 with *out set,
 * or -errno with a sentence in err: -ENOENT and other open errors,
 * -EINVAL for a malformed file, -ENOMEM. */
int expert_st_open(expert_st_file **out, const char *path, char *err, size_t errlen);

/* Tensors in the file, in data order (by begin). */
int expert_st_count(const expert_st_file *f);

/* Tensor i (0 <= i < count), or NULL. */
const expert_st_tensor *expert_st_at(const expert_st_file *f, int i);

/* The tensor named name, or NULL. */
const expert_st_tensor *expert_st_find(const expert_st_file *f, const char *name);

/* The metadata value of key, or NULL (owned by f). */
const char *expert_st_metadata(const expert_st_file *f, const char *key);

/* Reads tensor t of f as f32 into out (t->count floats; cap floats of room).
 * Returns 0, or -EINVAL (cap too small), -EIO (a short read: the file
 * changed since it was opened) with a sentence in err. */
int expert_st_read(expert_st_file *f, const expert_st_tensor *t, float *out, size_t cap, char *err,
                   size_t errlen);

/* Closes *f (NULL-safe) and sets it to NULL. */
void expert_st_close(expert_st_file **f);

/* One tensor to write: F32, C order. */
typedef struct expert_st_out {
    const char *name;
    const float *data;
    int ndim;
    uint64_t shape[EXPERT_ST_MAX_DIMS];
} expert_st_out;

/* Writes tensors t[0..n) and metadata (meta[2k] = key, meta[2k+1] = value,
 * n_meta pairs; may be 0) to path (see above). Returns 0, or -EINVAL (a bad
 * name, shape or a repeated name), -ENOMEM or the write's -errno with a
 * sentence in err. */
int expert_st_write(const char *path, const expert_st_out *t, int n, const char *const *meta, int n_meta,
                    char *err, size_t errlen);

/* Conversions to f32, exact (f16 subnormals, infinities and NaNs kept). */
float expert_st_f16_to_f32(uint16_t h);
float expert_st_bf16_to_f32(uint16_t h);

#endif
