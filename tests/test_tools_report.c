/* Progress lines and the SVG plot (tools/report.h). */
#include <errno.h>
#include <math.h>

#include "test_util.h"
#include "tools/report.h"

static void test_durations(void **state)
{
    (void)state;
    char b[32];
    report_format_duration(b, sizeof b, 0);
    assert_string_equal(b, "0s");
    report_format_duration(b, sizeof b, 59.4);
    assert_string_equal(b, "59s");
    report_format_duration(b, sizeof b, 185);
    assert_string_equal(b, "3m05s");
    report_format_duration(b, sizeof b, 3720);
    assert_string_equal(b, "1h02m");
    report_format_duration(b, sizeof b, NAN);
    assert_string_equal(b, "--");
    report_format_duration(b, sizeof b, -3);
    assert_string_equal(b, "--");
}

static void test_progress_lines(void **state)
{
    (void)state;
    report_progress p;
    char line[256];
    FILE *devnull = fopen("/dev/null", "w");
    assert_non_null(devnull);
    report_progress_init(&p, devnull, 1000, 0, 100.0);
    report_progress_format(&p, line, sizeof line, 250, 0.5, 110.0);
    /* 250 samples in 10 s: 25/s, 750 left: 30 s. */
    assert_non_null(strstr(line, "250/1000"));
    assert_non_null(strstr(line, "25 samples/s"));
    assert_non_null(strstr(line, "loss 0.5000"));
    assert_non_null(strstr(line, "eta 30s"));
    report_progress_init(&p, devnull, 1000, 1, 100.0);
    report_progress_format(&p, line, sizeof line, 500, 0.25, 110.0);
    assert_non_null(strstr(line, "[############............]"));
    assert_non_null(strstr(line, "ETA 10s"));
    /* Updates before the interval are suppressed, forced ones are not. */
    report_progress_init(&p, devnull, 1000, 0, 100.0);
    report_progress_update(&p, 1, 1.0, 100.0, 0);
    double first = p.last_draw;
    report_progress_update(&p, 2, 1.0, 101.0, 0);
    assert_true(p.last_draw == first);
    report_progress_update(&p, 3, 1.0, 101.0, 1);
    assert_true(p.last_draw == 101.0);
    fclose(devnull);
}

static int count(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p++)
        n++;
    return n;
}

static void test_svg(void **state)
{
    (void)state;
    char dir[256], path[512];
    static char buf[65536];
    test_tmpdir(dir, sizeof dir, "plot");
    snprintf(path, sizeof path, "%s/p.svg", dir);
    double x[5] = {0, 1, 2, 3, 4}, y[5] = {2.3, 1.1, NAN, 0.6, 0.5};
    double ex[2] = {1, 2}, acc[2] = {0.8, 0.85};
    report_series s[2] = {
        {"train loss <per step>", "#1f77b4", x, y, 5, 0},
        {"test accuracy", "#d62728", ex, acc, 2, 1},
    };
    assert_int_equal(report_plot_svg(path, "fmnist & co", "step", "loss", "accuracy", s, 2), 0);
    size_t n = test_read_file(path, buf, sizeof buf);
    assert_true(n > 500);
    assert_true(strncmp(buf, "<svg ", 5) == 0);
    assert_non_null(strstr(buf, "</svg>\n"));
    assert_int_equal(count(buf, "<polyline"), 2);
    assert_int_equal(count(buf, "<circle"), 6); /* a marker per finite point of sparse series */
    assert_non_null(strstr(buf, "fmnist &amp; co"));
    assert_non_null(strstr(buf, "train loss &lt;per step&gt;"));
    assert_null(strstr(buf, "nan"));
    /* 4 finite points in the first polyline, 2 in the second. */
    const char *p1 = strstr(buf, "points=\"");
    assert_non_null(p1);
    const char *e1 = strchr(p1 + 8, '"');
    int commas = 0;
    for (const char *c = p1; c < e1; c++)
        commas += *c == ',';
    assert_int_equal(commas, 4);
    /* Bad arguments; a directory that does not exist. */
    assert_int_equal(report_plot_svg(path, "t", "x", "y", "", s, 0), -EINVAL);
    assert_int_equal(report_plot_svg(path, "t", "x", "y", "", s, 5), -EINVAL);
    report_series bad = {"b", "#000", NULL, NULL, 3, 0};
    assert_int_equal(report_plot_svg(path, "t", "x", "y", "", &bad, 1), -EINVAL);
    snprintf(path, sizeof path, "%s/no/such/p.svg", dir);
    assert_int_equal(report_plot_svg(path, "t", "x", "y", "", s, 1), -ENOENT);
    /* Empty series still make a valid picture. */
    snprintf(path, sizeof path, "%s/e.svg", dir);
    report_series empty = {"none", "#000", x, y, 0, 0};
    assert_int_equal(report_plot_svg(path, "t", "x", "y", "", &empty, 1), 0);
    test_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_durations),
        cmocka_unit_test(test_progress_lines),
        cmocka_unit_test(test_svg),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
