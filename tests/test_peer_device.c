/* --device parsing and checking (peer/device.h). */
#include <errno.h>

#include "cuda/cuda.h"
#include "peer/device.h"
#include "test_util.h"

static void test_cpu(void **state)
{
    (void)state;
    peer_device d;
    char err[256];
    assert_int_equal(peer_device_parse("cpu", &d, err, sizeof err), 0);
    assert_int_equal(d.kind, PEER_DEVICE_CPU);
    assert_non_null(strstr(d.desc, "OpenBLAS"));
}

static void test_malformed(void **state)
{
    (void)state;
    static const char *bad[] = {"", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x",
                                "cuda:99999999999999999999", "CPU", "cpu ", NULL};
    peer_device d;
    char err[256];
    for (int i = 0; bad[i]; i++) {
        err[0] = '\0';
        int rc = peer_device_parse(bad[i], &d, err, sizeof err);
        if (rc != -EINVAL)
            fail_msg("'%s' gave %d, want -EINVAL", bad[i], rc);
        assert_non_null(strstr(err, "invalid device"));
    }
    assert_int_equal(peer_device_parse(NULL, &d, err, sizeof err), -EINVAL);
}

/* Without CUDA in the build or without a GPU, cuda:N fails with a clear
 * reason; with one, cuda:0 works and a too-large index fails. */
static void test_cuda(void **state)
{
    (void)state;
    peer_device d;
    char err[256] = "";
    int n = cuda_device_count();
    int rc = peer_device_parse("cuda:0", &d, err, sizeof err);
    if (!cuda_built()) {
        assert_int_equal(n, -ENOSYS);
        assert_int_equal(rc, -ENOSYS);
        assert_non_null(strstr(err, "no CUDA in this build"));
    } else if (n <= 0) {
        assert_int_equal(rc, n == 0 ? -ENODEV : n);
        assert_true(strlen(err) > 10);
    } else {
        assert_int_equal(rc, 0);
        assert_int_equal(d.kind, PEER_DEVICE_CUDA);
        assert_int_equal(peer_device_parse("cuda:4096", &d, err, sizeof err), -ENODEV);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_cuda),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
