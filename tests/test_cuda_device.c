/* The CUDA backend's device discovery. Needs a GPU: exits 77 (skipped)
 * without CUDA in the build or without a device. */
#include <errno.h>

#include "cuda/cuda.h"
#include "test_util.h"

static void test_describe_every_device(void **state)
{
    (void)state;
    int n = cuda_device_count();
    char buf[128];
    for (int i = 0; i < n; i++) {
        assert_int_equal(cuda_device_describe(i, buf, sizeof buf), 0);
        assert_non_null(strstr(buf, "sm_"));
    }
    assert_int_equal(cuda_device_describe(n, buf, sizeof buf), -ENODEV);
    assert_int_equal(cuda_device_describe(-1, buf, sizeof buf), -ENODEV);
}

int main(void)
{
    int n = cuda_device_count();
    if (n <= 0) {
        fprintf(stderr, "skipped: %s\n", cuda_strerror(n == 0 ? -ENODEV : n));
        return TEST_SKIP;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_describe_every_device),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
