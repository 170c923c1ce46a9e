#include "dht/id.h"

#include <errno.h>
#include <string.h>

#include <sodium.h>

void dht_id_of_bytes(uint8_t out[DHT_ID_LEN], const void *data, size_t len)
{
    /* crypto_generichash is BLAKE2b; 20 bytes is within its 16..64 range.
     * It cannot fail for these arguments, so the result is not checked. */
    crypto_generichash(out, DHT_ID_LEN, data, len, NULL, 0);
}

void dht_id_of_pubkey(uint8_t out[DHT_ID_LEN], const uint8_t pk[32])
{
    dht_id_of_bytes(out, pk, 32);
}

void dht_id_to_hex(char out[DHT_ID_HEX_LEN + 1], const uint8_t id[DHT_ID_LEN])
{
    sodium_bin2hex(out, DHT_ID_HEX_LEN + 1, id, DHT_ID_LEN);
}

int dht_id_from_hex(uint8_t out[DHT_ID_LEN], const char *hex)
{
    uint8_t tmp[DHT_ID_LEN];
    size_t bin_len = 0;
    const char *end = NULL;

    if (!out || !hex || strlen(hex) != DHT_ID_HEX_LEN)
        return -EINVAL;
    if (sodium_hex2bin(tmp, sizeof tmp, hex, DHT_ID_HEX_LEN, NULL, &bin_len, &end) != 0 ||
        bin_len != DHT_ID_LEN || *end != '\0')
        return -EINVAL;
    memcpy(out, tmp, DHT_ID_LEN);
    return 0;
}
