/* net/channel.c: handshake and record protection (see channel.h, docs/rpc.md). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#ifdef NET_HAVE_OPENSSL
#include <openssl/evp.h>
#endif

#include "dht/id.h"
#include "net/channel.h"

#define HS_VERSION 1
#define FLAG_AES 0x01u        /* sender can do AES-256-GCM in hardware */
#define FLAG_PLAINTEXT 0x02u  /* sender wants plaintext records (benchmarks) */

enum hs_state { HS_SEND1, HS_WAIT1, HS_WAIT2, HS_WAIT3, HS_DONE, HS_DEAD };

struct peer_channel {
    int initiator, sodium_only;
    enum hs_state st;
    uint8_t my_flags, peer_flags;
    dht_identity self;
    int have_expect;
    uint8_t expect_id[DHT_ID_LEN];
    uint8_t swarm[32];              /* all zero when no swarm key: same code path */
    size_t max_record;
    uint8_t e_sk[32], e_pk[32];     /* our ephemeral X25519 pair */
    uint8_t peer_e[32];
    uint8_t peer_pk[32], peer_id[DHT_ID_LEN];
    uint8_t msg1[PEER_CHANNEL_HS1_LEN], msg2[PEER_CHANNEL_HS2_LEN];
    peer_cipher cipher;
    uint64_t tx_n, rx_n;
    crypto_aead_aes256gcm_state aes_tx, aes_rx; /* precomputed AES key schedules */
    uint8_t k_tx[32], k_rx[32];
    /* The record being sealed / opened (streaming API), or NULL. */
    uint8_t *seal_rec, *open_rec;
    size_t seal_len, seal_done, open_len, open_done;
    uint8_t seal_nonce[12], open_nonce[12];
#ifdef NET_HAVE_OPENSSL
    /* OpenSSL's AES-GCM (VAES/AVX-512) runs about twice as fast as
     * libsodium 1.0.18's on current x86, and its ChaCha20-Poly1305 three
     * times; the records are byte-identical either way (same RFC
     * constructions), so a peer built without OpenSSL interoperates. */
    EVP_CIPHER_CTX *ossl_tx, *ossl_rx;
#endif
};

static void put_hdr(uint8_t *p, char which, uint8_t flags)
{
    p[0] = 'S'; p[1] = 'R'; p[2] = 'H'; p[3] = (uint8_t)which;
    p[4] = HS_VERSION; p[5] = flags; p[6] = 0; p[7] = 0;
}

static int check_hdr(const uint8_t *p, char which)
{
    if (p[0] != 'S' || p[1] != 'R' || p[2] != 'H' || p[3] != (uint8_t)which || p[4] != HS_VERSION)
        return -EPROTO;
    return 0;
}

/* BLAKE2b keyed with the swarm key (zeros without one) over label || a || b || c. */
static void khash(const peer_channel *ch, uint8_t *out, size_t outlen, const char *label,
                  const uint8_t *a, size_t alen, const uint8_t *b, size_t blen,
                  const uint8_t *c, size_t clen)
{
    crypto_generichash_state st;
    crypto_generichash_init(&st, ch->swarm, sizeof ch->swarm, outlen);
    crypto_generichash_update(&st, (const uint8_t *)label, strlen(label));
    if (alen) crypto_generichash_update(&st, a, alen);
    if (blen) crypto_generichash_update(&st, b, blen);
    if (clen) crypto_generichash_update(&st, c, clen);
    crypto_generichash_final(&st, out, outlen);
    sodium_memzero(&st, sizeof st);
}

#ifdef NET_HAVE_OPENSSL
static void ossl_free(peer_channel *ch)
{
    EVP_CIPHER_CTX_free(ch->ossl_tx);
    EVP_CIPHER_CTX_free(ch->ossl_rx);
    ch->ossl_tx = ch->ossl_rx = NULL;
}

/* Keys the two OpenSSL contexts; on any failure we stay on libsodium. */
static void ossl_setup(peer_channel *ch)
{
    const EVP_CIPHER *c = ch->cipher == PEER_CIPHER_AES256GCM ? EVP_aes_256_gcm()
                          : ch->cipher == PEER_CIPHER_CHACHA20POLY1305 ? EVP_chacha20_poly1305()
                                                                       : NULL;
    if (!c)
        return;
    ch->ossl_tx = EVP_CIPHER_CTX_new();
    ch->ossl_rx = EVP_CIPHER_CTX_new();
    if (!ch->ossl_tx || !ch->ossl_rx ||
        EVP_EncryptInit_ex(ch->ossl_tx, c, NULL, ch->k_tx, NULL) != 1 ||
        EVP_DecryptInit_ex(ch->ossl_rx, c, NULL, ch->k_rx, NULL) != 1)
        ossl_free(ch);
}

/* One AEAD record with OpenSSL: 12-byte nonce, 4-byte AD, 16-byte tag. */
static int ossl_seal(EVP_CIPHER_CTX *x, uint8_t *c, uint8_t *tag, const uint8_t *m, size_t n,
                     const uint8_t *ad, const uint8_t nonce[12])
{
    int len;
    if (EVP_EncryptInit_ex(x, NULL, NULL, NULL, nonce) != 1 ||
        EVP_EncryptUpdate(x, NULL, &len, ad, PEER_CHANNEL_HDR_LEN) != 1)
        return -1;
    /* EVP lengths are int: feed large records in 1 GiB pieces. */
    for (size_t off = 0; off < n;) {
        int piece = n - off > (1u << 30) ? (1 << 30) : (int)(n - off);
        if (EVP_EncryptUpdate(x, c + off, &len, m + off, piece) != 1)
            return -1;
        off += (size_t)piece;
    }
    if (EVP_EncryptFinal_ex(x, c + n, &len) != 1 ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_AEAD_GET_TAG, PEER_CHANNEL_TAG_LEN, tag) != 1)
        return -1;
    return 0;
}

static int ossl_open(EVP_CIPHER_CTX *x, uint8_t *m, const uint8_t *c, size_t n, const uint8_t *tag,
                     const uint8_t *ad, const uint8_t nonce[12])
{
    int len;
    if (EVP_DecryptInit_ex(x, NULL, NULL, NULL, nonce) != 1 ||
        EVP_DecryptUpdate(x, NULL, &len, ad, PEER_CHANNEL_HDR_LEN) != 1)
        return -1;
    for (size_t off = 0; off < n;) {
        int piece = n - off > (1u << 30) ? (1 << 30) : (int)(n - off);
        if (EVP_DecryptUpdate(x, m + off, &len, c + off, piece) != 1)
            return -1;
        off += (size_t)piece;
    }
    if (EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_AEAD_SET_TAG, PEER_CHANNEL_TAG_LEN, (void *)tag) != 1 ||
        EVP_DecryptFinal_ex(x, m + n, &len) != 1)
        return -1;
    return 0;
}
#endif

peer_channel *peer_channel_create(const peer_channel_config *cfg, int initiator)
{
    if (!cfg || !cfg->self)
        return NULL;
    if (sodium_init() < 0)
        return NULL;
    /* 64-byte alignment for the AES key schedule (CRYPTO_ALIGN(16)). */
    size_t sz = (sizeof(peer_channel) + 63) & ~(size_t)63;
    peer_channel *ch = aligned_alloc(64, sz);
    if (!ch)
        return NULL;
    memset(ch, 0, sizeof *ch);
    ch->initiator = initiator != 0;
    ch->sodium_only = cfg->sodium_only != 0;
    ch->st = ch->initiator ? HS_SEND1 : HS_WAIT1;
    ch->self = *cfg->self;
    if (cfg->expect_id) {
        ch->have_expect = 1;
        memcpy(ch->expect_id, cfg->expect_id, DHT_ID_LEN);
    }
    if (cfg->swarm_key)
        memcpy(ch->swarm, cfg->swarm_key, 32);
    ch->max_record = cfg->max_record ? cfg->max_record : PEER_CHANNEL_MAX_RECORD;
    if (!cfg->no_aes && crypto_aead_aes256gcm_is_available())
        ch->my_flags |= FLAG_AES;
    if (cfg->plaintext)
        ch->my_flags |= FLAG_PLAINTEXT;
    crypto_box_keypair(ch->e_pk, ch->e_sk); /* X25519 pair */
    return ch;
}

void peer_channel_destroy(peer_channel **p)
{
    if (!p || !*p)
        return;
#ifdef NET_HAVE_OPENSSL
    ossl_free(*p);
#endif
    sodium_memzero(*p, sizeof **p);
    free(*p);
    *p = NULL;
}

static int die(peer_channel *ch, int err)
{
    ch->st = HS_DEAD;
    ch->seal_rec = ch->open_rec = NULL;
#ifdef NET_HAVE_OPENSSL
    ossl_free(ch);
#endif
    sodium_memzero(ch->k_tx, 32);
    sodium_memzero(ch->k_rx, 32);
    return err;
}

/* Both flags must agree on plaintext; AES only if both can. */
static int negotiate(peer_channel *ch)
{
    if ((ch->my_flags ^ ch->peer_flags) & FLAG_PLAINTEXT)
        return -EPROTO;
    if (ch->my_flags & FLAG_PLAINTEXT)
        ch->cipher = PEER_CIPHER_NONE;
    else if (ch->my_flags & ch->peer_flags & FLAG_AES)
        ch->cipher = PEER_CIPHER_AES256GCM;
    else
        ch->cipher = PEER_CIPHER_CHACHA20POLY1305;
    return 0;
}

/* Checks the peer's ed25519 key against the expected ID and records it. */
static int take_peer_pk(peer_channel *ch, const uint8_t *pk)
{
    memcpy(ch->peer_pk, pk, 32);
    dht_id_of_pubkey(ch->peer_id, pk);
    if (ch->have_expect && sodium_memcmp(ch->peer_id, ch->expect_id, DHT_ID_LEN) != 0)
        return -EPERM;
    return 0;
}

/* Derives both directions' keys from the transcript hash h3 and three DH
 * products. Returns 0 or -EBADMSG (a key that converts or multiplies to a
 * degenerate point). */
static int derive(peer_channel *ch, const uint8_t h3[32])
{
    uint8_t my_x_sk[32], peer_x_pk[32], ee[32], es[32], se[32], okm[64];
    int rc = -EBADMSG;
    if (crypto_sign_ed25519_sk_to_curve25519(my_x_sk, ch->self.sk) != 0 ||
        crypto_sign_ed25519_pk_to_curve25519(peer_x_pk, ch->peer_pk) != 0)
        goto out;
    if (crypto_scalarmult(ee, ch->e_sk, ch->peer_e) != 0)
        goto out;
    /* es = initiator ephemeral * responder static, se = initiator static *
     * responder ephemeral; each side computes the same two products. */
    if (ch->initiator) {
        if (crypto_scalarmult(es, ch->e_sk, peer_x_pk) != 0 ||
            crypto_scalarmult(se, my_x_sk, ch->peer_e) != 0)
            goto out;
    } else {
        if (crypto_scalarmult(es, my_x_sk, ch->peer_e) != 0 ||
            crypto_scalarmult(se, ch->e_sk, peer_x_pk) != 0)
            goto out;
    }
    uint8_t dh[96];
    memcpy(dh, ee, 32);
    memcpy(dh + 32, es, 32);
    memcpy(dh + 64, se, 32);
    khash(ch, okm, 64, "starling-keys-v1", h3, 32, dh, 96, NULL, 0);
    sodium_memzero(dh, sizeof dh);
    /* okm[0..32) protects initiator -> responder, okm[32..64) the reverse. */
    memcpy(ch->k_tx, ch->initiator ? okm : okm + 32, 32);
    memcpy(ch->k_rx, ch->initiator ? okm + 32 : okm, 32);
    if (ch->cipher == PEER_CIPHER_AES256GCM) {
        crypto_aead_aes256gcm_beforenm(&ch->aes_tx, ch->k_tx);
        crypto_aead_aes256gcm_beforenm(&ch->aes_rx, ch->k_rx);
    }
#ifdef NET_HAVE_OPENSSL
    if (!ch->sodium_only)
        ossl_setup(ch);
#endif
    ch->tx_n = ch->rx_n = 0;
    rc = 0;
out:
    sodium_memzero(my_x_sk, 32);
    sodium_memzero(ee, 32);
    sodium_memzero(es, 32);
    sodium_memzero(se, 32);
    sodium_memzero(okm, 64);
    sodium_memzero(ch->e_sk, 32);
    return rc;
}

int peer_channel_hello(peer_channel *ch, uint8_t out[PEER_CHANNEL_HS_MAX])
{
    if (!ch || !out || ch->st != HS_SEND1)
        return -EINVAL;
    uint8_t *m = ch->msg1;
    put_hdr(m, '1', ch->my_flags);
    memcpy(m + 8, ch->e_pk, 32);
    khash(ch, m + 40, 32, "starling-swarm-v1", m, 40, NULL, 0, NULL, 0);
    memcpy(out, m, PEER_CHANNEL_HS1_LEN);
    ch->st = HS_WAIT2;
    return PEER_CHANNEL_HS1_LEN;
}

size_t peer_channel_hs_expect(const peer_channel *ch)
{
    if (!ch)
        return 0;
    switch (ch->st) {
    case HS_WAIT1: return PEER_CHANNEL_HS1_LEN;
    case HS_WAIT2: return PEER_CHANNEL_HS2_LEN;
    case HS_WAIT3: return PEER_CHANNEL_HS3_LEN;
    default: return 0;
    }
}

static int on_msg1(peer_channel *ch, const uint8_t *m, uint8_t *out, size_t *out_len)
{
    uint8_t tag[32];
    int rc = check_hdr(m, '1');
    if (rc)
        return rc;
    khash(ch, tag, 32, "starling-swarm-v1", m, 40, NULL, 0, NULL, 0);
    if (sodium_memcmp(tag, m + 40, 32) != 0)
        return -EACCES;
    ch->peer_flags = m[5];
    if ((rc = negotiate(ch)) != 0)
        return rc;
    memcpy(ch->msg1, m, PEER_CHANNEL_HS1_LEN);
    memcpy(ch->peer_e, m + 8, 32);

    uint8_t *r = ch->msg2, h2[32];
    put_hdr(r, '2', ch->my_flags);
    memcpy(r + 8, ch->e_pk, 32);
    memcpy(r + 40, ch->self.pk, 32);
    khash(ch, h2, 32, "starling-hs2-v1", ch->msg1, PEER_CHANNEL_HS1_LEN, r, 72, NULL, 0);
    crypto_sign_detached(r + 72, NULL, h2, 32, ch->self.sk);
    khash(ch, r + 136, 32, "starling-swarm-v1", ch->msg1, PEER_CHANNEL_HS1_LEN, r, 136, NULL, 0);
    memcpy(out, r, PEER_CHANNEL_HS2_LEN);
    *out_len = PEER_CHANNEL_HS2_LEN;
    ch->st = HS_WAIT3;
    return 0;
}

static int on_msg2(peer_channel *ch, const uint8_t *m, uint8_t *out, size_t *out_len)
{
    uint8_t tag[32], h2[32], h3[32];
    int rc = check_hdr(m, '2');
    if (rc)
        return rc;
    khash(ch, tag, 32, "starling-swarm-v1", ch->msg1, PEER_CHANNEL_HS1_LEN, m, 136, NULL, 0);
    if (sodium_memcmp(tag, m + 136, 32) != 0)
        return -EACCES;
    ch->peer_flags = m[5];
    if ((rc = negotiate(ch)) != 0)
        return rc;
    if ((rc = take_peer_pk(ch, m + 40)) != 0)
        return rc;
    khash(ch, h2, 32, "starling-hs2-v1", ch->msg1, PEER_CHANNEL_HS1_LEN, m, 72, NULL, 0);
    if (crypto_sign_verify_detached(m + 72, h2, 32, ch->peer_pk) != 0)
        return -EBADMSG;
    memcpy(ch->msg2, m, PEER_CHANNEL_HS2_LEN);
    memcpy(ch->peer_e, m + 8, 32);

    uint8_t *r = out;
    put_hdr(r, '3', ch->my_flags);
    memcpy(r + 8, ch->self.pk, 32);
    khash(ch, h3, 32, "starling-hs3-v1", ch->msg1, PEER_CHANNEL_HS1_LEN, ch->msg2,
          PEER_CHANNEL_HS2_LEN, r, 40);
    crypto_sign_detached(r + 40, NULL, h3, 32, ch->self.sk);
    *out_len = PEER_CHANNEL_HS3_LEN;
    if ((rc = derive(ch, h3)) != 0)
        return rc;
    ch->st = HS_DONE;
    return 1;
}

static int on_msg3(peer_channel *ch, const uint8_t *m)
{
    uint8_t h3[32];
    int rc = check_hdr(m, '3');
    if (rc)
        return rc;
    /* msg3's flags must repeat msg1's: both are signed, so this closes the
     * door on a downgrade of the cipher choice in msg1. */
    if (m[5] != ch->peer_flags)
        return -EBADMSG;
    if ((rc = take_peer_pk(ch, m + 8)) != 0)
        return rc;
    khash(ch, h3, 32, "starling-hs3-v1", ch->msg1, PEER_CHANNEL_HS1_LEN, ch->msg2,
          PEER_CHANNEL_HS2_LEN, m, 40);
    if (crypto_sign_verify_detached(m + 40, h3, 32, ch->peer_pk) != 0)
        return -EBADMSG;
    if ((rc = derive(ch, h3)) != 0)
        return rc;
    ch->st = HS_DONE;
    return 1;
}

int peer_channel_hs_input(peer_channel *ch, const uint8_t *msg,
                          uint8_t out[PEER_CHANNEL_HS_MAX], size_t *out_len)
{
    if (!ch || !msg || !out || !out_len)
        return -EINVAL;
    *out_len = 0;
    int rc;
    switch (ch->st) {
    case HS_WAIT1: rc = on_msg1(ch, msg, out, out_len); break;
    case HS_WAIT2: rc = on_msg2(ch, msg, out, out_len); break;
    case HS_WAIT3: rc = on_msg3(ch, msg); break;
    default: return -EINVAL;
    }
    if (rc < 0) {
        *out_len = 0;
        return die(ch, rc);
    }
    return rc;
}

int peer_channel_established(const peer_channel *ch)
{
    return ch && ch->st == HS_DONE;
}

const uint8_t *peer_channel_peer_pk(const peer_channel *ch)
{
    return ch->peer_pk;
}

const uint8_t *peer_channel_peer_id(const peer_channel *ch)
{
    return ch->peer_id;
}

peer_cipher peer_channel_cipher(const peer_channel *ch)
{
    return ch->cipher;
}

size_t peer_channel_tag_len(const peer_channel *ch)
{
    return ch->cipher == PEER_CIPHER_NONE ? 0 : PEER_CHANNEL_TAG_LEN;
}

static void make_nonce(uint8_t nonce[12], uint64_t n)
{
    for (int i = 0; i < 8; i++)
        nonce[i] = (uint8_t)(n >> (8 * i));
    nonce[8] = nonce[9] = nonce[10] = nonce[11] = 0;
}

static void put_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}

/* Sealing and opening are streaming (begin, update..., final) so that the
 * RPC layer can encrypt straight from the caller's tensors into the send
 * buffer and write each piece while it encrypts the next, and decrypt a
 * large record while the rest of it is still arriving. With OpenSSL the
 * updates do the work; with libsodium (one-shot API only) update copies and
 * final does the whole record. */
int peer_channel_seal_begin(peer_channel *ch, uint8_t *rec, size_t plain_len)
{
    if (!ch || !rec || ch->st != HS_DONE || ch->seal_rec)
        return -EINVAL;
    if (plain_len > ch->max_record)
        return -EMSGSIZE;
    put_le32(rec, (uint32_t)(plain_len + peer_channel_tag_len(ch)));
    make_nonce(ch->seal_nonce, ch->tx_n++);
    ch->seal_rec = rec;
    ch->seal_len = plain_len;
    ch->seal_done = 0;
#ifdef NET_HAVE_OPENSSL
    int len;
    if (ch->ossl_tx && (EVP_EncryptInit_ex(ch->ossl_tx, NULL, NULL, NULL, ch->seal_nonce) != 1 ||
                        EVP_EncryptUpdate(ch->ossl_tx, NULL, &len, rec, PEER_CHANNEL_HDR_LEN) != 1))
        return die(ch, -EIO);
#endif
    return 0;
}

int peer_channel_seal_update(peer_channel *ch, uint8_t *dst, const uint8_t *src, size_t n)
{
    if (!ch || !ch->seal_rec || dst != ch->seal_rec + PEER_CHANNEL_HDR_LEN + ch->seal_done ||
        n > ch->seal_len - ch->seal_done)
        return -EINVAL;
    if (!n)
        return 0;
#ifdef NET_HAVE_OPENSSL
    if (ch->ossl_tx) {
        for (size_t off = 0; off < n;) {
            int len, piece = n - off > (1u << 30) ? (1 << 30) : (int)(n - off);
            if (EVP_EncryptUpdate(ch->ossl_tx, dst + off, &len, src + off, piece) != 1)
                return die(ch, -EIO);
            off += (size_t)piece;
        }
        ch->seal_done += n;
        return 0;
    }
#endif
    if (dst != src)
        memmove(dst, src, n);
    ch->seal_done += n;
    return 0;
}

long peer_channel_seal_final(peer_channel *ch)
{
    if (!ch || !ch->seal_rec || ch->seal_done != ch->seal_len)
        return -EINVAL;
    uint8_t *rec = ch->seal_rec, *m = rec + PEER_CHANNEL_HDR_LEN;
    size_t n = ch->seal_len, tag = peer_channel_tag_len(ch);
    ch->seal_rec = NULL;
#ifdef NET_HAVE_OPENSSL
    if (ch->ossl_tx) {
        int len;
        if (EVP_EncryptFinal_ex(ch->ossl_tx, m + n, &len) != 1 ||
            EVP_CIPHER_CTX_ctrl(ch->ossl_tx, EVP_CTRL_AEAD_GET_TAG, PEER_CHANNEL_TAG_LEN, m + n) != 1)
            return die(ch, -EIO);
        return (long)(PEER_CHANNEL_HDR_LEN + n + tag);
    }
#endif
    switch (ch->cipher) {
    case PEER_CIPHER_NONE:
        break;
    case PEER_CIPHER_AES256GCM:
        crypto_aead_aes256gcm_encrypt_detached_afternm(m, m + n, NULL, m, n, rec,
                                                        PEER_CHANNEL_HDR_LEN, NULL,
                                                        ch->seal_nonce, &ch->aes_tx);
        break;
    case PEER_CIPHER_CHACHA20POLY1305:
        crypto_aead_chacha20poly1305_ietf_encrypt_detached(m, m + n, NULL, m, n, rec,
                                                           PEER_CHANNEL_HDR_LEN, NULL,
                                                           ch->seal_nonce, ch->k_tx);
        break;
    }
    return (long)(PEER_CHANNEL_HDR_LEN + n + tag);
}

long peer_channel_seal(peer_channel *ch, uint8_t *rec, size_t plain_len)
{
    int rc = peer_channel_seal_begin(ch, rec, plain_len);
    if (rc)
        return rc;
    uint8_t *m = rec + PEER_CHANNEL_HDR_LEN;
    if ((rc = peer_channel_seal_update(ch, m, m, plain_len)) != 0)
        return rc;
    return peer_channel_seal_final(ch);
}

int peer_channel_record_len(const peer_channel *ch, const uint8_t hdr[PEER_CHANNEL_HDR_LEN],
                            size_t *rec_len)
{
    size_t L = (size_t)hdr[0] | (size_t)hdr[1] << 8 | (size_t)hdr[2] << 16 | (size_t)hdr[3] << 24;
    size_t tag = peer_channel_tag_len(ch);
    if (L < tag)
        return -EBADMSG;
    if (L - tag > ch->max_record)
        return -EMSGSIZE;
    *rec_len = PEER_CHANNEL_HDR_LEN + L;
    return 0;
}

int peer_channel_open_begin(peer_channel *ch, uint8_t *rec, size_t rec_len)
{
    if (!ch || !rec || ch->st != HS_DONE || ch->open_rec)
        return -EINVAL;
    size_t want;
    if (rec_len < PEER_CHANNEL_HDR_LEN || peer_channel_record_len(ch, rec, &want) != 0 ||
        want != rec_len)
        return die(ch, -EBADMSG);
    make_nonce(ch->open_nonce, ch->rx_n++);
    ch->open_rec = rec;
    ch->open_len = rec_len - PEER_CHANNEL_HDR_LEN - peer_channel_tag_len(ch);
    ch->open_done = 0;
#ifdef NET_HAVE_OPENSSL
    int len;
    if (ch->ossl_rx && (EVP_DecryptInit_ex(ch->ossl_rx, NULL, NULL, NULL, ch->open_nonce) != 1 ||
                        EVP_DecryptUpdate(ch->ossl_rx, NULL, &len, rec, PEER_CHANNEL_HDR_LEN) != 1))
        return die(ch, -EBADMSG);
#endif
    return 0;
}

size_t peer_channel_open_done(const peer_channel *ch)
{
    return ch && ch->open_rec ? ch->open_done : 0;
}

int peer_channel_open_update(peer_channel *ch, size_t n)
{
    if (!ch || !ch->open_rec || n > ch->open_len - ch->open_done)
        return -EINVAL;
#ifdef NET_HAVE_OPENSSL
    if (ch->ossl_rx) {
        uint8_t *c = ch->open_rec + PEER_CHANNEL_HDR_LEN + ch->open_done;
        for (size_t off = 0; off < n;) {
            int len, piece = n - off > (1u << 30) ? (1 << 30) : (int)(n - off);
            if (EVP_DecryptUpdate(ch->ossl_rx, c + off, &len, c + off, piece) != 1)
                return die(ch, -EBADMSG);
            off += (size_t)piece;
        }
    }
#endif
    ch->open_done += n;
    return 0;
}

int peer_channel_open_final(peer_channel *ch, uint8_t **plain, size_t *plain_len)
{
    if (!ch || !ch->open_rec || !plain || !plain_len)
        return -EINVAL;
    int rc = peer_channel_open_update(ch, ch->open_len - ch->open_done);
    if (rc)
        return rc;
    uint8_t *rec = ch->open_rec, *c = rec + PEER_CHANNEL_HDR_LEN;
    size_t n = ch->open_len;
    ch->open_rec = NULL;
    int bad = 0;
#ifdef NET_HAVE_OPENSSL
    if (ch->ossl_rx) {
        int len;
        if (EVP_CIPHER_CTX_ctrl(ch->ossl_rx, EVP_CTRL_AEAD_SET_TAG, PEER_CHANNEL_TAG_LEN, c + n) != 1 ||
            EVP_DecryptFinal_ex(ch->ossl_rx, c + n, &len) != 1)
            return die(ch, -EBADMSG);
        *plain = c;
        *plain_len = n;
        return 0;
    }
#endif
    switch (ch->cipher) {
    case PEER_CIPHER_NONE:
        break;
    case PEER_CIPHER_AES256GCM:
        bad = crypto_aead_aes256gcm_decrypt_detached_afternm(c, NULL, c, n, c + n, rec,
                                                             PEER_CHANNEL_HDR_LEN, ch->open_nonce,
                                                             &ch->aes_rx) != 0;
        break;
    case PEER_CIPHER_CHACHA20POLY1305:
        bad = crypto_aead_chacha20poly1305_ietf_decrypt_detached(c, NULL, c, n, c + n, rec,
                                                                 PEER_CHANNEL_HDR_LEN,
                                                                 ch->open_nonce, ch->k_rx) != 0;
        break;
    }
    if (bad)
        return die(ch, -EBADMSG);
    *plain = c;
    *plain_len = n;
    return 0;
}

int peer_channel_open(peer_channel *ch, uint8_t *rec, size_t rec_len,
                      uint8_t **plain, size_t *plain_len)
{
    if (!plain || !plain_len)
        return -EINVAL;
    int rc = peer_channel_open_begin(ch, rec, rec_len);
    if (rc)
        return rc;
    return peer_channel_open_final(ch, plain, plain_len);
}

int peer__channel_selftest(void)
{
#ifdef NET_HAVE_OPENSSL
    if (sodium_init() < 0)
        return -EIO;
    static const size_t sizes[] = {0, 1, 15, 16, 17, 1000, 65536 + 3};
    uint8_t key[32], nonce[12], ad[4], tag[16];
    size_t maxn = 65536 + 3;
    uint8_t *m = malloc(maxn), *c = malloc(maxn), *back = malloc(maxn);
    EVP_CIPHER_CTX *x = EVP_CIPHER_CTX_new();
    int rc = -EIO;
    if (!m || !c || !back || !x)
        goto out;
    for (int alg = 0; alg < 2; alg++) {
        if (alg == 0 && !crypto_aead_aes256gcm_is_available())
            continue;
        const EVP_CIPHER *ev = alg == 0 ? EVP_aes_256_gcm() : EVP_chacha20_poly1305();
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            size_t n = sizes[i];
            randombytes_buf(key, 32);
            randombytes_buf(nonce, 12);
            randombytes_buf(ad, 4);
            randombytes_buf(m, n);
            /* OpenSSL seals, libsodium opens. */
            if (EVP_EncryptInit_ex(x, ev, NULL, key, NULL) != 1 ||
                ossl_seal(x, c, tag, m, n, ad, nonce) != 0)
                goto out;
            int bad;
            if (alg == 0)
                bad = crypto_aead_aes256gcm_decrypt_detached(back, NULL, c, n, tag, ad, 4, nonce, key);
            else
                bad = crypto_aead_chacha20poly1305_ietf_decrypt_detached(back, NULL, c, n, tag, ad, 4,
                                                                         nonce, key);
            if (bad || memcmp(back, m, n) != 0)
                goto out;
            /* libsodium seals, OpenSSL opens; then a flipped tag bit fails. */
            if (alg == 0)
                crypto_aead_aes256gcm_encrypt_detached(c, tag, NULL, m, n, ad, 4, NULL, nonce, key);
            else
                crypto_aead_chacha20poly1305_ietf_encrypt_detached(c, tag, NULL, m, n, ad, 4, NULL,
                                                                   nonce, key);
            if (EVP_DecryptInit_ex(x, ev, NULL, key, NULL) != 1 ||
                ossl_open(x, back, c, n, tag, ad, nonce) != 0 || memcmp(back, m, n) != 0)
                goto out;
            tag[3] ^= 1;
            if (ossl_open(x, back, c, n, tag, ad, nonce) == 0)
                goto out;
        }
    }
    rc = 0;
out:
    EVP_CIPHER_CTX_free(x);
    free(m);
    free(c);
    free(back);
    return rc;
#else
    return -ENOSYS;
#endif
}

int peer_channel_streams(const peer_channel *ch)
{
#ifdef NET_HAVE_OPENSSL
    if (ch && ch->ossl_tx)
        return 1;
#endif
    return ch && ch->st == HS_DONE && ch->cipher == PEER_CIPHER_NONE;
}
