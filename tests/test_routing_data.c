/* Fashion-MNIST IDX loading (routing/data.h): real files and hostile ones. */
#include <errno.h>
#include <math.h>
#include <sys/stat.h>

#include <zlib.h>

#include "routing/data.h"
#include "test_util.h"

static char dir[256];

static int setup(void **state)
{
    (void)state;
    test_tmpdir(dir, sizeof dir, "data");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    test_rmtree(dir);
    return 0;
}

static void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* Writes a gzip-compressed (gz=1) or plain IDX file dir/name. */
static void write_idx(const char *name, int gz, uint32_t magic, int ndims, const uint32_t *dims,
                      const uint8_t *data, size_t len)
{
    char path[512];
    uint8_t hdr[16];
    put_be32(hdr, magic);
    for (int i = 0; i < ndims; i++)
        put_be32(hdr + 4 + 4 * i, dims[i]);
    size_t hlen = 4 + 4 * (size_t)ndims;
    if (gz) {
        snprintf(path, sizeof path, "%s/%s.gz", dir, name);
        gzFile f = gzopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(gzwrite(f, hdr, (unsigned)hlen), (int)hlen);
        if (len)
            assert_int_equal(gzwrite(f, data, (unsigned)len), (int)len);
        assert_int_equal(gzclose(f), Z_OK);
    } else {
        snprintf(path, sizeof path, "%s/%s", dir, name);
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        fwrite(hdr, 1, hlen, f);
        if (len)
            fwrite(data, 1, len, f);
        fclose(f);
    }
}

/* A tiny valid split: 3 images of 2x2 and 3 labels. */
static void write_small_split(int gz, int nlabels)
{
    uint32_t idims[3] = {3, 2, 2}, ldims[1] = {(uint32_t)nlabels};
    uint8_t pix[12] = {0, 255, 128, 64, 1, 2, 3, 4, 5, 6, 7, 8};
    uint8_t lab[4] = {9, 0, 4, 2};
    write_idx("t10k-images-idx3-ubyte", gz, 0x803, 3, idims, pix, sizeof pix);
    write_idx("t10k-labels-idx1-ubyte", gz, 0x801, 1, ldims, lab, (size_t)nlabels);
}

static void test_small_gz_and_plain(void **state)
{
    (void)state;
    char err[512];
    route_dataset d;
    for (int gz = 0; gz <= 1; gz++) {
        write_small_split(gz, 3);
        assert_int_equal(route_data_load(&d, dir, "t10k", err, sizeof err), 0);
        assert_int_equal(d.n, 3);
        assert_int_equal(d.rows, 2);
        assert_int_equal(d.cols, 2);
        assert_int_equal(d.classes, 10);
        assert_int_equal(d.labels[0], 9);
        float want0 = (0.0f / 255.0f - ROUTE_FMNIST_MEAN) / ROUTE_FMNIST_STD;
        float want1 = (255.0f / 255.0f - ROUTE_FMNIST_MEAN) / ROUTE_FMNIST_STD;
        assert_true(fabsf(d.images[0] - want0) < 1e-5f);
        assert_true(fabsf(d.images[1] - want1) < 1e-5f);
        route_data_free(&d);
        assert_null(d.images);
        test_rmtree(dir);
        assert_int_equal(mkdir(dir, 0700), 0);
    }
}

static void expect_bad(const char *what, int want_rc)
{
    char err[512] = "";
    route_dataset d;
    int rc = route_data_load(&d, dir, "t10k", err, sizeof err);
    if (rc != want_rc)
        fail_msg("%s: got %d want %d (%s)", what, rc, want_rc, err);
    assert_null(d.images);
    assert_null(d.labels);
    assert_true(strlen(err) > 10); /* a sentence for the user */
}

static void test_hostile_files(void **state)
{
    (void)state;
    uint8_t pix[12] = {0};
    uint32_t ldims[1] = {3};
    uint8_t lab[3] = {1, 2, 3};

    expect_bad("missing files", -ENOENT);

    /* Labels count differs from images count. */
    write_small_split(1, 4);
    expect_bad("count mismatch", -EBADMSG);

    /* Wrong magic. */
    uint32_t idims[3] = {3, 2, 2};
    write_idx("t10k-images-idx3-ubyte", 1, 0x0803 ^ 0x100, 3, idims, pix, sizeof pix);
    write_idx("t10k-labels-idx1-ubyte", 1, 0x801, 1, ldims, lab, 3);
    expect_bad("wrong magic", -EBADMSG);

    /* Truncated pixel data. */
    write_idx("t10k-images-idx3-ubyte", 1, 0x803, 3, idims, pix, sizeof pix - 1);
    expect_bad("truncated", -EBADMSG);

    /* Trailing bytes. */
    uint8_t more[13] = {0};
    write_idx("t10k-images-idx3-ubyte", 1, 0x803, 3, idims, more, sizeof more);
    expect_bad("trailing", -EBADMSG);

    /* Absurd dimensions must not allocate gigabytes. */
    uint32_t huge[3] = {0xFFFFFFFFu, 28, 28};
    write_idx("t10k-images-idx3-ubyte", 1, 0x803, 3, huge, pix, sizeof pix);
    expect_bad("huge count", -EBADMSG);
    uint32_t zero[3] = {3, 0, 2};
    write_idx("t10k-images-idx3-ubyte", 1, 0x803, 3, zero, pix, sizeof pix);
    expect_bad("zero side", -EBADMSG);

    /* Random garbage, seeded; some of it compressed, some not. */
    char path[512];
    srand(777);
    for (int r = 0; r < 40; r++) {
        uint8_t junk[300];
        size_t len = (size_t)(rand() % (int)sizeof junk);
        for (size_t i = 0; i < len; i++)
            junk[i] = (uint8_t)rand();
        if (r % 2 && len > 2) {
            junk[0] = 0x1f; /* gzip magic, then garbage */
            junk[1] = 0x8b;
        }
        snprintf(path, sizeof path, "%s/t10k-images-idx3-ubyte.gz", dir);
        test_write_file(path, junk, len, 0600);
        expect_bad("garbage", -EBADMSG);
    }
}

static void test_bad_arguments(void **state)
{
    (void)state;
    char err[256];
    route_dataset d;
    assert_int_equal(route_data_load(&d, dir, "valid", err, sizeof err), -EINVAL);
    assert_int_equal(route_data_load(NULL, dir, "t10k", err, sizeof err), -EINVAL);
    char out[256];
    assert_int_equal(route_data_find_dir("/nonexistent/dir", out, sizeof out, err, sizeof err), -ENOENT);
    assert_non_null(strstr(err, "/nonexistent/dir"));
    assert_int_equal(route_data_find_dir(dir, out, sizeof out, err, sizeof err), 0);
    assert_string_equal(out, dir);
}

static void test_load_files(void **state)
{
    (void)state;
    char err[512], img[600], lab[600];
    route_dataset d;
    write_small_split(1, 3);
    snprintf(img, sizeof img, "%s/t10k-images-idx3-ubyte.gz", dir);
    snprintf(lab, sizeof lab, "%s/t10k-labels-idx1-ubyte.gz", dir);
    assert_int_equal(route_data_load_files(&d, img, NULL, err, sizeof err), 0);
    assert_int_equal(d.n, 3);
    assert_null(d.labels);
    assert_int_equal(d.classes, 0);
    route_data_free(&d);
    assert_int_equal(route_data_load_files(&d, img, lab, err, sizeof err), 0);
    assert_int_equal(d.labels[2], 4);
    route_data_free(&d);
    /* A labels file given as images (wrong magic), a missing file. */
    assert_int_equal(route_data_load_files(&d, lab, NULL, err, sizeof err), -EBADMSG);
    assert_non_null(strstr(err, "labels-idx1"));
    snprintf(img, sizeof img, "%s/none.gz", dir);
    assert_int_equal(route_data_load_files(&d, img, NULL, err, sizeof err), -ENOENT);
    assert_null(d.images);
}

/* The real data set from Debian's dataset-fashion-mnist (tools/test.sh
 * installs it); skipped when absent so the unit test runs anywhere. */
static void test_real_fashion_mnist(void **state)
{
    (void)state;
    char real[512], err[512];
    route_dataset tr, te;
    if (route_data_find_dir(NULL, real, sizeof real, err, sizeof err) != 0)
        skip();
    assert_int_equal(route_data_load(&te, real, "t10k", err, sizeof err), 0);
    assert_int_equal(te.n, 10000);
    assert_int_equal(te.rows, 28);
    assert_int_equal(te.cols, 28);
    assert_int_equal(te.classes, 10);
    int counts[10] = {0};
    for (int i = 0; i < te.n; i++)
        counts[te.labels[i]]++;
    for (int k = 0; k < 10; k++)
        assert_int_equal(counts[k], 1000); /* the test set is balanced */
    assert_int_equal(route_data_load(&tr, real, "train", err, sizeof err), 0);
    assert_int_equal(tr.n, 60000);
    /* Normalisation uses the training set's statistics: mean ~0, std ~1. */
    double s = 0, s2 = 0;
    size_t n = (size_t)tr.n * 784;
    for (size_t i = 0; i < n; i++) {
        s += tr.images[i];
        s2 += (double)tr.images[i] * tr.images[i];
    }
    double mean = s / (double)n, var = s2 / (double)n - mean * mean;
    assert_true(fabs(mean) < 1e-3);
    assert_true(fabs(sqrt(var) - 1.0) < 1e-3);
    route_data_free(&tr);
    route_data_free(&te);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_small_gz_and_plain, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hostile_files, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_arguments, setup, teardown),
        cmocka_unit_test_setup_teardown(test_load_files, setup, teardown),
        cmocka_unit_test(test_real_fashion_mnist),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
