/* expert/modelfile.h: models as data: model files (JSON, format
 * "starling.model.v1", docs/models.md) to struct expert_model_spec and back.
 *
 * A model file is parsed strictly: an unknown key, an unknown block kind, a
 * value of the wrong type or out of range, a missing key, widths that do not
 * chain from the task's input through every stage to the task's output, or
 * bytes that are not JSON (or not UTF-8) are each refused with one sentence
 * that names the file and the key's path, e.g.
 *   model.json: stages[2].hiden: unknown key (known for resffn: kind, dim, hidden, repeat)
 *
 * The canonical form (expert_model_to_json) is the spec as compact JSON with
 * sorted keys and every field explicit; parsing it gives the same spec back,
 * and two files that mean the same model give the same canonical bytes.
 *
 * Every function here is thread-safe (no shared state).
 */
#ifndef EXPERT_MODELFILE_H
#define EXPERT_MODELFILE_H

#include <stddef.h>

#include "expert/model.h"

#define EXPERT_MODELFILE_FORMAT "starling.model.v1"
/* Largest model file (and in-memory description) accepted, bytes. */
#define EXPERT_MODELFILE_MAX_BYTES (1 << 20)
/* Longest model name ([a-z0-9][a-z0-9._-]*) and description, bytes. */
#define EXPERT_MODEL_NAME_MAX 48
#define EXPERT_MODEL_DESC_MAX 1024
/* Most stages of one model (= routing's ROUTE_PIPELINE_MAX_STAGES). */
#define EXPERT_MODEL_MAX_STAGES 64

/* Parses the model file at path. Returns an owned spec (free it with
 * expert_model_free), or NULL with a sentence in err naming path and the key
 * at fault. */
struct expert_model_spec *expert_model_load_file(const char *path, char *err, size_t errlen);

/* The same from len bytes at text (need not be NUL-terminated; at most
 * EXPERT_MODELFILE_MAX_BYTES), e.g. a description fetched from the DHT;
 * label names the source in errors (NULL: "model"). */
struct expert_model_spec *expert_model_parse(const char *text, size_t len, const char *label,
                                             char *err, size_t errlen);

/* Frees a spec returned by the functions above (NULL-safe). Never pass a
 * built-in or registered spec. */
void expert_model_free(struct expert_model_spec *m);

/* The canonical JSON text of m (NUL-terminated; free() it): compact, keys
 * sorted, every field explicit, stages listed one by one (no "repeat").
 * expert_model_parse of it gives a spec equal to m. NULL when m is not a
 * valid model (the spec a model file could not describe) or out of memory. */
char *expert_model_to_json(const struct expert_model_spec *m);

/* 1 when a and b describe the same model (names, descriptions, task, batch
 * sizes and every stage's config), else 0. */
int expert_model_equal(const struct expert_model_spec *a, const struct expert_model_spec *b);

/* 0 when name is a valid model name: 1..EXPERT_MODEL_NAME_MAX bytes of
 * [a-z0-9._-], starting with [a-z0-9], not ending in '.' nor in '.' and
 * digits only (so "<name>.<index>" stage ids split at their last dot are
 * never ambiguous). -EINVAL otherwise. */
int expert_model_name_check(const char *name);

#endif
