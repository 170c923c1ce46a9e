/* routing/tokens.h: pre-tokenized training data in llm.c's .bin format, so
 * tokens from any tokenizer can be brought (train_llama.py's --tokens).
 *
 * A file is a header of 256 little-endian int32 (header[0] = magic,
 * header[1] = version, header[2] = the number of tokens n, the rest zero)
 * followed by n tokens, little-endian:
 *   magic 20240520, version 1: uint16 tokens (llm.c's GPT-2 format)
 *   magic 20240520, version 2: uint32 tokens (train_llama.py's extension)
 *   magic 20240801, version 7: uint32 tokens (llm.c's Llama-3 format; read only)
 * Reading checks the header, that the file holds exactly 1024 + n x width
 * bytes, and that every token is below the vocabulary; each fault is one
 * sentence naming the file. Thread-safe: no shared state.
 */
#ifndef ROUTE_TOKENS_H
#define ROUTE_TOKENS_H

#include <stddef.h>
#include <stdint.h>

#define ROUTE_TOKENS_MAGIC 20240520
#define ROUTE_TOKENS_MAGIC_LLAMA3 20240801
#define ROUTE_TOKENS_HEADER 1024

/* Reads path into *out (malloc'd; the caller frees it) and *n. vocab > 0:
 * a token >= vocab is refused (naming its index). Returns 0, or -errno
 * (-EINVAL for a malformed file, -ERANGE for a token out of range, I/O
 * errors, -ENOMEM) with a sentence in err. */
int route_tokens_load(const char *path, uint32_t vocab, uint32_t **out, size_t *n, char *err, size_t errlen);

/* Writes t[0..n) to path: version 1 (uint16) when every token is below
 * 65536, else version 2 (uint32); through a temporary file renamed into
 * place. Returns 0 or -errno with a sentence in err. */
int route_tokens_write(const char *path, const uint32_t *t, size_t n, char *err, size_t errlen);

#endif
