/* tests/fake_modeldesc.c: a forger's model description (swarm/modeldesc.h),
 * as "KEY_HEX VALUE_HEX" lines for `starling dht put KEY VALUE --raw-key
 * --value-hex` to store signed by the forger's own identity
 * (tests/test_swarm_modelpub.sh). Not a test itself.
 *
 *     fake_modeldesc hash FILE
 *         prints the description hash (40 hex digits) of FILE's model
 *     fake_modeldesc publish NAME N_STAGES HASH_FILE CONTENT_FILE
 *         a models index entry naming NAME (N_STAGES stages) whose "d" is
 *         the description hash of HASH_FILE, and the chunks of
 *         CONTENT_FILE stored under that hash's keys
 *
 * A FILE that is a model file stands for its canonical JSON; any other
 * file for its bytes as they are.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dht/id.h"
#include "expert/model.h"
#include "expert/modelfile.h"
#include "swarm/announce.h"
#include "swarm/modeldesc.h"

/* The canonical JSON of the model file at path, or its raw bytes. */
static char *load(const char *path, size_t *len)
{
    char err[512];
    struct expert_model_spec *m = expert_model_load_file(path, err, sizeof err);
    if (m) {
        char *json = expert_model_to_json(m);
        expert_model_free(m);
        if (json)
            *len = strlen(json);
        return json;
    }
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = malloc(PEER_MODELDESC_MAX_BYTES + 1);
    *len = buf ? fread(buf, 1, PEER_MODELDESC_MAX_BYTES, f) : 0;
    fclose(f);
    return buf;
}

static void hex(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        printf("%02x", p[i]);
}

int main(int argc, char **argv)
{
    uint8_t h[PEER_MODELDESC_HASH_LEN], key[DHT_ID_LEN], val[DHT_MAX_VALUE];
    size_t len = 0, clen = 0;
    if (argc == 3 && !strcmp(argv[1], "hash")) {
        char *text = load(argv[2], &len);
        if (!text || !len) {
            fprintf(stderr, "fake_modeldesc: cannot read %s\n", argv[2]);
            return 1;
        }
        peer_modeldesc_hash(h, text, len);
        hex(h, sizeof h);
        printf("\n");
        free(text);
        return 0;
    }
    if (argc != 6 || strcmp(argv[1], "publish") != 0) {
        fprintf(stderr, "usage: fake_modeldesc hash FILE\n"
                        "       fake_modeldesc publish NAME N_STAGES HASH_FILE CONTENT_FILE\n");
        return 2;
    }
    char *text = load(argv[4], &len), *content = load(argv[5], &clen);
    if (!text || !content || !len || !clen) {
        fprintf(stderr, "fake_modeldesc: cannot read %s or %s\n", argv[4], argv[5]);
        return 1;
    }
    peer_model_record m;
    memset(&m, 0, sizeof m);
    snprintf(m.model, sizeof m.model, "%s", argv[2]);
    m.n_stages = atoi(argv[3]);
    m.has_desc = 1;
    peer_modeldesc_hash(m.desc_hash, text, len);
    long n = peer_model_record_encode(&m, val, sizeof val);
    if (n < 0) {
        fprintf(stderr, "fake_modeldesc: cannot encode the index entry\n");
        return 1;
    }
    dht_id_of_bytes(key, PEER_MODELS_KEY, strlen(PEER_MODELS_KEY));
    hex(key, sizeof key);
    printf(" ");
    hex(val, (size_t)n);
    printf("\n");
    int chunks = peer_modeldesc_chunks(clen);
    for (int i = 0; i < chunks; i++) {
        n = peer_modeldesc_chunk_encode(content, clen, i, val, sizeof val);
        if (n < 0) {
            fprintf(stderr, "fake_modeldesc: cannot encode chunk %d\n", i);
            return 1;
        }
        peer_modeldesc_key(key, m.desc_hash, i);
        hex(key, sizeof key);
        printf(" ");
        hex(val, (size_t)n);
        printf("\n");
    }
    free(text);
    free(content);
    return 0;
}
