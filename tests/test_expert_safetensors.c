/* Safetensors weight files (expert/safetensors.h): a round trip exact to
 * the bit, the header as train_llama.py writes it, F16/BF16/F64 read as
 * f32, and every kind of malformed file refused with a sentence: short
 * files, header lengths past the file, bytes that are not a JSON object,
 * repeated keys, entries with missing or mistyped fields, dtypes that are
 * not floats or not dtypes at all, too many dimensions, offsets reversed,
 * past the data, overlapping or leaving holes, sizes that do not match the
 * shape, metadata that is not strings; then thousands of files with
 * flipped and truncated bytes, each either read or refused (ASan/UBSan
 * watch the reads). */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "expert/safetensors.h"
#include "test_util.h"

static char dir[256];

static void path_of(char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/%s", dir, name);
}

/* Writes a file: 8-byte header length, the header (unpadded), data. */
static void raw_file(const char *path, const char *header, const void *data, size_t dlen)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint64_t n = strlen(header);
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)(n >> (8 * i));
    assert_int_equal(fwrite(len8, 1, 8, f), 8);
    assert_int_equal(fwrite(header, 1, n, f), n);
    if (dlen)
        assert_int_equal(fwrite(data, 1, dlen, f), dlen);
    assert_int_equal(fclose(f), 0);
}

/* Opens a file that must be refused with -EINVAL and an error naming the
 * file and containing `says`. */
static void refused(const char *path, const char *says)
{
    expert_st_file *f = NULL;
    char err[400] = "";
    int rc = expert_st_open(&f, path, err, sizeof err);
    if (rc != -EINVAL || !strstr(err, path) || !strstr(err, says))
        fail_msg("%s: rc %d, error \"%s\" (wanted -EINVAL and \"%s\")", path, rc, err, says);
    assert_null(f);
}

static void test_round_trip(void **state)
{
    (void)state;
    float a[6] = {1.5f, -2.25f, 0.0f, -0.0f, 3e-39f, INFINITY}, b[4] = {NAN, 1e30f, -1e-30f, 7.0f}, c[1] = {42};
    expert_st_out t[3] = {{"model.embed_tokens.weight", a, 2, {2, 3}},
                          {"model.norm.weight", b, 1, {4}},
                          {"scalar", c, 0, {0}}};
    const char *meta[] = {"format", "pt", "producer", "starling"};
    char p[300], err[300];
    path_of(p, sizeof p, "rt.safetensors");
    assert_int_equal(expert_st_write(p, t, 3, meta, 2, err, sizeof err), 0);

    /* The header as train_llama.py writes it: compact, metadata first,
     * padded with spaces to a multiple of 8. */
    FILE *fp = fopen(p, "rb");
    uint8_t raw[400];
    size_t got = fread(raw, 1, sizeof raw, fp);
    fclose(fp);
    uint64_t hn = 0;
    for (int i = 7; i >= 0; i--)
        hn = hn << 8 | raw[i];
    assert_int_equal(hn % 8, 0);
    assert_true(got == 8 + hn + 4 * 11);
    const char *want = "{\"__metadata__\":{\"format\":\"pt\",\"producer\":\"starling\"},"
                       "\"model.embed_tokens.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},";
    assert_memory_equal(raw + 8, want, strlen(want));

    expert_st_file *f = NULL;
    assert_int_equal(expert_st_open(&f, p, err, sizeof err), 0);
    assert_int_equal(expert_st_count(f), 3);
    assert_string_equal(expert_st_metadata(f, "producer"), "starling");
    assert_null(expert_st_metadata(f, "nothing"));
    const expert_st_tensor *e = expert_st_find(f, "model.embed_tokens.weight");
    assert_non_null(e);
    assert_int_equal(e->ndim, 2);
    assert_int_equal(e->shape[1], 3);
    assert_int_equal(e->count, 6);
    float out[6];
    assert_int_equal(expert_st_read(f, e, out, 6, err, sizeof err), 0);
    assert_memory_equal(out, a, sizeof a);
    assert_int_equal(expert_st_read(f, e, out, 5, err, sizeof err), -EINVAL); /* no room */
    e = expert_st_find(f, "model.norm.weight");
    assert_int_equal(expert_st_read(f, e, out, 6, err, sizeof err), 0);
    assert_memory_equal(out, b, sizeof b); /* NaN's bits too */
    e = expert_st_find(f, "scalar");
    assert_int_equal(e->ndim, 0);
    assert_int_equal(e->count, 1);
    assert_int_equal(expert_st_read(f, e, out, 1, err, sizeof err), 0);
    assert_true(out[0] == 42.0f);
    assert_null(expert_st_find(f, "missing"));
    assert_null(expert_st_at(f, 3));
    expert_st_close(&f);
    assert_null(f);

    /* Bad tensors to write: refused, and the file written before stays. */
    expert_st_out dup[2] = {{"x", a, 1, {2}}, {"x", b, 1, {2}}};
    assert_int_equal(expert_st_write(p, dup, 2, NULL, 0, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "repeated"));
    expert_st_out meta_name[1] = {{"__metadata__", a, 1, {2}}};
    assert_int_equal(expert_st_write(p, meta_name, 1, NULL, 0, err, sizeof err), -EINVAL);
    assert_int_equal(expert_st_write("/nonexistent-dir/x.safetensors", t, 1, NULL, 0, err, sizeof err), -ENOENT);
    assert_int_equal(expert_st_open(&f, p, err, sizeof err), 0);
    assert_int_equal(expert_st_count(f), 3);
    expert_st_close(&f);
}

/* F16, BF16 and F64 read as f32: each value exact where f32 holds it. */
static void test_conversions(void **state)
{
    (void)state;
    assert_true(expert_st_f16_to_f32(0x3c00) == 1.0f);
    assert_true(expert_st_f16_to_f32(0xc000) == -2.0f);
    assert_true(expert_st_f16_to_f32(0x7bff) == 65504.0f);
    assert_true(expert_st_f16_to_f32(0x0001) == ldexpf(1.0f, -24)); /* smallest subnormal */
    assert_true(expert_st_f16_to_f32(0x03ff) == ldexpf(1023.0f, -24));
    assert_true(expert_st_f16_to_f32(0x0400) == ldexpf(1.0f, -14)); /* smallest normal */
    assert_true(isinf(expert_st_f16_to_f32(0xfc00)) && expert_st_f16_to_f32(0xfc00) < 0);
    assert_true(isnan(expert_st_f16_to_f32(0x7e00)));
    assert_true(signbit(expert_st_f16_to_f32(0x8000)));
    assert_true(expert_st_bf16_to_f32(0x3f80) == 1.0f);
    assert_true(expert_st_bf16_to_f32(0xc2f7) == -123.5f);
    /* Every finite f16 value against its definition: (-1)^s m 2^-24 for
     * exponent field 0, (-1)^s (1024 + m) 2^(e-25) otherwise. */
    for (uint32_t h = 0; h < 0x10000; h++) {
        uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
        if (e == 0x1f)
            continue;
        double want = e == 0 ? ldexp((double)m, -24) : ldexp(1024.0 + m, (int)e - 25);
        if (h & 0x8000)
            want = -want;
        float v = expert_st_f16_to_f32((uint16_t)h);
        if ((double)v != want || (signbit(v) != 0) != ((h & 0x8000) != 0))
            fail_msg("f16 %04x -> %g, wanted %g", h, (double)v, want);
    }

    char p[300], err[300];
    path_of(p, sizeof p, "dtypes.safetensors");
    uint8_t data[2 * 2 + 2 * 2 + 8];
    uint16_t f16[2] = {0x3c00, 0xc000}, bf16[2] = {0x3f80, 0xc2f7};
    double f64 = -0.1;
    memcpy(data, f16, 4);
    memcpy(data + 4, bf16, 4);
    memcpy(data + 8, &f64, 8);
    raw_file(p,
             "{\"h\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]},"
             "\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[4,8]},"
             "\"d\":{\"dtype\":\"F64\",\"shape\":[1,1],\"data_offsets\":[8,16]}}",
             data, sizeof data);
    expert_st_file *f = NULL;
    assert_int_equal(expert_st_open(&f, p, err, sizeof err), 0);
    float out[2];
    assert_int_equal(expert_st_read(f, expert_st_find(f, "h"), out, 2, err, sizeof err), 0);
    assert_true(out[0] == 1.0f && out[1] == -2.0f);
    assert_int_equal(expert_st_read(f, expert_st_find(f, "b"), out, 2, err, sizeof err), 0);
    assert_true(out[0] == 1.0f && out[1] == -123.5f);
    assert_int_equal(expert_st_read(f, expert_st_find(f, "d"), out, 2, err, sizeof err), 0);
    assert_true(out[0] == (float)-0.1);
    /* In data order, whatever the header's order. */
    assert_string_equal(expert_st_at(f, 0)->name, "h");
    assert_string_equal(expert_st_at(f, 2)->name, "d");
    expert_st_close(&f);
}

static void test_malformed(void **state)
{
    (void)state;
    static const struct {
        const char *header;
        size_t dlen;
        const char *says;
    } cases[] = {
        {"[1,2]", 0, "not a JSON object"},
        {"{\"a\":", 0, "not JSON"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "not JSON"},
        {"{\"a\":7}", 0, "not a JSON object"},
        {"{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "exactly dtype"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4, "exactly dtype"},
        {"{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "exactly dtype"},
        {"{\"a\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, "not a float format"},
        {"{\"a\":{\"dtype\":\"F31\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "not a safetensors dtype"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}", 4, "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, "9 dimensions"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", 4, "too large"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, "two non-negative"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, "outside"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}}", 4, "outside"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, "hold 4 bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "hole"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, "cover 4 bytes"},
        {"{\"__metadata__\":{\"k\":1}}", 0, "not a string"},
        {"{\"__metadata__\":[]}", 0, "__metadata__ is not"},
        {"{\"\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "empty"},
    };
    uint8_t zeros[16] = {0};
    char p[300];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char name[40];
        snprintf(name, sizeof name, "bad%zu.safetensors", i);
        path_of(p, sizeof p, name);
        raw_file(p, cases[i].header, zeros, cases[i].dlen);
        refused(p, cases[i].says);
    }
    /* An empty file, a header length past the file, a directory. */
    path_of(p, sizeof p, "empty.safetensors");
    FILE *f = fopen(p, "wb");
    fclose(f);
    refused(p, "shorter than");
    path_of(p, sizeof p, "long.safetensors");
    f = fopen(p, "wb");
    uint8_t len8[8] = {0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0};
    fwrite(len8, 1, 8, f);
    fwrite("{}", 1, 2, f);
    fclose(f);
    refused(p, "a header of 4294967295 bytes");
    refused(dir, "not a regular file");
    expert_st_file *sf = NULL;
    char err[300];
    path_of(p, sizeof p, "absent.safetensors");
    assert_int_equal(expert_st_open(&sf, p, err, sizeof err), -ENOENT);
    assert_non_null(strstr(err, "absent.safetensors"));
}

/* Flipped and cut bytes of a valid file: each mutant is read or refused,
 * and a mutant that opens reads every tensor within its bounds. */
static void test_garbage(void **state)
{
    (void)state;
    float a[32];
    for (int i = 0; i < 32; i++)
        a[i] = (float)i;
    expert_st_out t[2] = {{"w", a, 2, {4, 4}}, {"b", a + 16, 1, {16}}};
    char p[300], q[300], err[300];
    path_of(p, sizeof p, "good.safetensors");
    path_of(q, sizeof q, "mutant.safetensors");
    assert_int_equal(expert_st_write(p, t, 2, NULL, 0, err, sizeof err), 0);
    FILE *fp = fopen(p, "rb");
    uint8_t good[1024];
    size_t n = fread(good, 1, sizeof good, fp);
    fclose(fp);
    uint64_t rng = 0x9e3779b97f4a7c15ULL;
    int opened = 0;
    for (int k = 0; k < 3000; k++) {
        uint8_t m[1024];
        memcpy(m, good, n);
        size_t len = n;
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        int flips = 1 + (int)(rng % 4);
        for (int j = 0; j < flips; j++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            m[rng % len] ^= (uint8_t)(1u << (rng >> 32) % 8);
        }
        if (k % 5 == 0)
            len = (size_t)(rng >> 40) % n;
        fp = fopen(q, "wb");
        fwrite(m, 1, len, fp);
        fclose(fp);
        expert_st_file *f = NULL;
        int rc = expert_st_open(&f, q, err, sizeof err);
        if (rc != 0) {
            assert_int_equal(rc, -EINVAL);
            assert_true(err[0] != '\0');
            continue;
        }
        opened++;
        for (int i = 0; i < expert_st_count(f); i++) {
            const expert_st_tensor *e = expert_st_at(f, i);
            float out[64];
            if (e->count <= 64)
                assert_int_equal(expert_st_read(f, e, out, 64, err, sizeof err), 0);
        }
        expert_st_close(&f);
    }
    /* Flips in the data or in spaces leave files that open. */
    assert_true(opened > 100);
}

static int setup(void **state)
{
    (void)state;
    test_tmpdir(dir, sizeof dir, "safetensors");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    test_rmtree(dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_conversions),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_garbage),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
