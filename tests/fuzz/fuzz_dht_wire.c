/* libFuzzer target for the DHT datagram decoder and the node's input path.
 *
 *   CC=clang meson setup build-fuzz -Dfuzz=true -Dcuda=disabled \
 *       -Db_sanitize=address,undefined -Db_lundef=false
 *   ninja -C build-fuzz tests/fuzz_dht_wire && build-fuzz/tests/fuzz_dht_wire -max_len=1400
 *
 * Each input is decoded; what decodes must re-encode and decode to the same
 * message. Then the bytes go to a live node (as a request or as a reply to
 * nothing), which must never crash, and must drop what does not decode.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dht/dht.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static dht_node *node;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    dht_msg m, m2;
    uint8_t buf[DHT_MAX_DATAGRAM];
    if (!node) {
        dht_identity id;
        uint8_t seed[32] = {1};
        dht_config cfg;
        dht_identity_from_seed(&id, seed);
        dht_config_default(&cfg);
        cfg.rate_per_s = 1000000;
        cfg.rate_burst = 1000000;
        node = dht_node_create(&id, &cfg, 1700000000000ull);
        if (!node)
            abort();
    }
    if (dht_wire_decode(&m, data, size) == 0) {
        int len = dht_wire_encode(&m, buf, sizeof buf);
        if (len > 0) {
            if (dht_wire_decode(&m2, buf, (size_t)len) != 0)
                abort(); /* our own output must decode */
            if (m2.type != m.type || m2.tid != m.tid || m2.n_nodes != m.n_nodes ||
                m2.n_entries != m.n_entries || memcmp(m2.id, m.id, DHT_ID_LEN) != 0)
                abort();
        }
    }
    uint32_t tid;
    if (dht_wire_decode_reject(data, size, &tid) == 0) {
        int len = dht_wire_encode_reject(tid, buf, sizeof buf);
        uint32_t tid2 = 0;
        if (len <= 0 || dht_wire_decode_reject(buf, (size_t)len, &tid2) != 0 || tid2 != tid)
            abort();
    }
    dht_addr from;
    const uint8_t ip[4] = {10, 0, 0, 1};
    dht_addr_v4(&from, ip, 4000);
    dht_node_stats before, after;
    dht_node_get_stats(node, &before);
    int rc = dht_node_input(node, data, size, &from, 1700000000000ull);
    dht_node_get_stats(node, &after);
    if (rc == -EBADMSG && after.drop_malformed != before.drop_malformed + 1)
        abort();
    dht_addr to;
    while (dht_node_pop_output(node, buf, sizeof buf, &to) > 0)
        ;
    return 0;
}
