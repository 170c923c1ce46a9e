/* tools/report.h: what a training run shows and leaves behind.
 *
 * - A progress line: on a terminal it redraws in place (a bar with samples/s,
 *   loss and ETA); otherwise it prints plain lines at most every few seconds
 *   so logs stay readable.
 * - A metrics log: one JSON object per line (JSON Lines), appended as the run
 *   goes, so a crash loses nothing already written.
 * - A plot: an SVG image with the training loss per logged step and the test
 *   accuracy per epoch, written at the end. SVG needs no font or image
 *   library and opens in any browser.
 */
#ifndef TOOLS_REPORT_H
#define TOOLS_REPORT_H

#include <stdio.h>

typedef struct report_progress {
    FILE *out;          /* where to draw (stderr usually); borrowed */
    int tty;            /* redraw in place with \r */
    double start;       /* monotonic seconds at start */
    double last_draw;   /* monotonic seconds of the last line drawn */
    double min_interval;/* seconds between plain lines (tty: between redraws) */
    long total;         /* samples in the whole run (for the bar and ETA) */
    const char *rate_unit; /* what the rate counts: "samples" (init), "tokens", ... */
    double rate_scale;  /* rate_unit per sample (init: 1; a language model: its context) */
} report_progress;

/* Starts a progress display of `total` samples on out. tty < 0 means "ask
 * isatty(fileno(out))". */
void report_progress_init(report_progress *p, FILE *out, long total, int tty, double now);

/* Formats the progress line into buf (no newline): done/total samples, a bar
 * on a terminal, samples/s since start, loss, ETA. Returns the length. */
int report_progress_format(const report_progress *p, char *buf, size_t len, long done,
                           double loss, double now);

/* Draws the line if min_interval has passed (or force != 0). */
void report_progress_update(report_progress *p, long done, double loss, double now, int force);

/* Ends the display (a final newline on a terminal). */
void report_progress_finish(report_progress *p);

/* Formats seconds as "1h02m", "3m05s" or "12s" into buf. */
void report_format_duration(char *buf, size_t len, double seconds);

/* A series of (x, y) points for the plot; owned by the caller. */
typedef struct report_series {
    const char *name;     /* legend text, XML-escaped on output */
    const char *color;    /* CSS colour, e.g. "#1f77b4" */
    const double *x, *y;
    int n;
    int right_axis;       /* 0: left axis; 1: right axis */
} report_series;

/* Writes an SVG line chart with up to 4 series to path (via a temporary
 * file and rename). Non-finite points are skipped. Returns 0 or -errno;
 * -EINVAL for bad arguments. */
int report_plot_svg(const char *path, const char *title, const char *xlabel,
                    const char *left_label, const char *right_label,
                    const report_series *series, int nseries);

#endif
