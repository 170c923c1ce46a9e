#include "tools/report.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

void report_format_duration(char *buf, size_t len, double s)
{
    if (!(s >= 0) || !isfinite(s) || s > 1e8) {
        snprintf(buf, len, "--");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, len, "%ldh%02ldm", t / 3600, (t / 60) % 60);
    else if (t >= 60)
        snprintf(buf, len, "%ldm%02lds", t / 60, t % 60);
    else
        snprintf(buf, len, "%lds", t);
}

void report_progress_init(report_progress *p, FILE *out, long total, int tty, double now)
{
    memset(p, 0, sizeof *p);
    p->out = out;
    p->tty = tty < 0 ? isatty(fileno(out)) : tty;
    p->start = now;
    p->last_draw = -1e30;
    p->min_interval = p->tty ? 0.2 : 5.0;
    p->total = total;
    p->rate_unit = "samples";
    p->rate_scale = 1.0;
}

int report_progress_format(const report_progress *p, char *buf, size_t len, long done,
                           double loss, double now)
{
    double el = now - p->start;
    double rate = el > 0 ? (double)done / el : 0;
    double eta = rate > 0 && p->total > done ? (double)(p->total - done) / rate : 0;
    char etas[32], bar[32];
    report_format_duration(etas, sizeof etas, eta);
    double frac = p->total > 0 ? (double)done / (double)p->total : 0;
    if (frac > 1)
        frac = 1;
    int n = 0;
    if (p->tty) {
        const int W = 24;
        int fill = (int)(frac * W + 0.5);
        for (int i = 0; i < W; i++)
            bar[i] = i < fill ? '#' : '.';
        bar[W] = '\0';
        n = snprintf(buf, len, "[%s] %3.0f%% %ld/%ld  %.0f %s/s  loss %.4f  ETA %s", bar,
                     frac * 100, done, p->total, rate * p->rate_scale, p->rate_unit, loss, etas);
    } else {
        n = snprintf(buf, len, "progress %ld/%ld (%.1f%%) %.0f %s/s loss %.4f eta %s", done,
                     p->total, frac * 100, rate * p->rate_scale, p->rate_unit, loss, etas);
    }
    return n < 0 ? 0 : n;
}

void report_progress_update(report_progress *p, long done, double loss, double now, int force)
{
    if (!force && now - p->last_draw < p->min_interval)
        return;
    char line[256];
    report_progress_format(p, line, sizeof line, done, loss, now);
    if (p->tty)
        fprintf(p->out, "\r\033[K%s", line);
    else
        fprintf(p->out, "%s\n", line);
    fflush(p->out);
    p->last_draw = now;
}

void report_progress_finish(report_progress *p)
{
    if (p->tty) {
        fputc('\n', p->out);
        fflush(p->out);
    }
}

static void xml_text(FILE *f, const char *s)
{
    for (; s && *s; s++) {
        switch (*s) {
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '&': fputs("&amp;", f); break;
        case '"': fputs("&quot;", f); break;
        default:
            if ((unsigned char)*s >= 0x20)
                fputc(*s, f);
        }
    }
}

/* Rounds a span to 1, 2 or 5 times a power of ten for tick spacing. */
static double nice_step(double span, int ticks)
{
    double raw = span / ticks;
    double p10 = pow(10, floor(log10(raw)));
    double m = raw / p10;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p10;
}

typedef struct range {
    double lo, hi;
} range;

static void range_of(const report_series *s, int ns, int right, int use_x, range *r)
{
    r->lo = INFINITY;
    r->hi = -INFINITY;
    for (int k = 0; k < ns; k++) {
        if (!use_x && s[k].right_axis != right)
            continue;
        for (int i = 0; i < s[k].n; i++) {
            double v = use_x ? s[k].x[i] : s[k].y[i];
            if (!isfinite(s[k].x[i]) || !isfinite(s[k].y[i]))
                continue;
            if (v < r->lo)
                r->lo = v;
            if (v > r->hi)
                r->hi = v;
        }
    }
    if (!isfinite(r->lo)) {
        r->lo = 0;
        r->hi = 1;
    }
    if (r->hi - r->lo < 1e-12) {
        r->hi += 0.5;
        r->lo -= 0.5;
    }
    double step = nice_step(r->hi - r->lo, 5);
    r->lo = floor(r->lo / step) * step;
    r->hi = ceil(r->hi / step) * step;
}

/* Whether every finite value on the right axis lies in 0..1 (there is at
 * least one): accuracies and other fractions read best on a fixed 0..1
 * axis. */
static int right_axis_is_fractions(const report_series *series, int nseries)
{
    int fractions = 0, others = 0;
    for (int k = 0; k < nseries; k++)
        for (int i = 0; series[k].right_axis && i < series[k].n; i++) {
            if (!isfinite(series[k].y[i]))
                continue;
            if (series[k].y[i] >= 0 && series[k].y[i] <= 1)
                fractions++;
            else
                others++;
        }
    return fractions > 0 && others == 0;
}

int report_plot_svg(const char *path, const char *title, const char *xlabel,
                    const char *left_label, const char *right_label,
                    const report_series *series, int nseries)
{
    if (!path || !series || nseries < 1 || nseries > 4)
        return -EINVAL;
    for (int k = 0; k < nseries; k++)
        if (series[k].n < 0 || (series[k].n > 0 && (!series[k].x || !series[k].y)))
            return -EINVAL;
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        return -ENAMETOOLONG;
    FILE *f = fopen(tmp, "w");
    if (!f)
        return -errno;

    const double W = 800, H = 480, L = 70, R = 70, T = 50, B = 60;
    const double pw = W - L - R, ph = H - T - B;
    range xr, yl, yr;
    range_of(series, nseries, 0, 1, &xr);
    range_of(series, nseries, 0, 0, &yl);
    range_of(series, nseries, 1, 0, &yr);
    if (right_axis_is_fractions(series, nseries)) {
        yr.lo = 0;
        yr.hi = 1;
    }

    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
               "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"12\">\n",
            W, H, W, H);
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    fprintf(f, "<text x=\"%.0f\" y=\"28\" text-anchor=\"middle\" font-size=\"16\">", W / 2);
    xml_text(f, title);
    fprintf(f, "</text>\n");
    fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" "
               "stroke=\"#444\"/>\n", L, T, pw, ph);

    /* Ticks and grid. */
    double xs = nice_step(xr.hi - xr.lo, 6);
    for (double v = xr.lo; v <= xr.hi + xs * 1e-6; v += xs) {
        double px = L + (v - xr.lo) / (xr.hi - xr.lo) * pw;
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"#ddd\"/>"
                   "<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%g</text>\n",
                px, T, px, T + ph, px, T + ph + 16, v);
    }
    double ys = nice_step(yl.hi - yl.lo, 5);
    for (double v = yl.lo; v <= yl.hi + ys * 1e-6; v += ys) {
        double py = T + ph - (v - yl.lo) / (yl.hi - yl.lo) * ph;
        fprintf(f, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                   "<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                L, py, L + pw, py, L - 6, py + 4, v);
    }
    int has_right = 0;
    for (int k = 0; k < nseries; k++)
        has_right |= series[k].right_axis;
    if (has_right) {
        double rs = nice_step(yr.hi - yr.lo, 5);
        for (double v = yr.lo; v <= yr.hi + rs * 1e-6; v += rs) {
            double py = T + ph - (v - yr.lo) / (yr.hi - yr.lo) * ph;
            fprintf(f, "<text x=\"%.0f\" y=\"%.1f\">%g</text>\n", L + pw + 6, py + 4, v);
        }
    }
    fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">", L + pw / 2, H - 18);
    xml_text(f, xlabel);
    fprintf(f, "</text>\n<text transform=\"translate(18,%.0f) rotate(-90)\" "
               "text-anchor=\"middle\">", T + ph / 2);
    xml_text(f, left_label);
    fprintf(f, "</text>\n");
    if (has_right) {
        fprintf(f, "<text transform=\"translate(%.0f,%.0f) rotate(90)\" text-anchor=\"middle\">",
                W - 14, T + ph / 2);
        xml_text(f, right_label);
        fprintf(f, "</text>\n");
    }

    for (int k = 0; k < nseries; k++) {
        const report_series *s = &series[k];
        const range *yrg = s->right_axis ? &yr : &yl;
        fprintf(f, "<polyline fill=\"none\" stroke-width=\"1.5\" stroke=\"");
        xml_text(f, s->color ? s->color : "#000");
        fprintf(f, "\" points=\"");
        for (int i = 0; i < s->n; i++) {
            if (!isfinite(s->x[i]) || !isfinite(s->y[i]))
                continue;
            double px = L + (s->x[i] - xr.lo) / (xr.hi - xr.lo) * pw;
            double py = T + ph - (s->y[i] - yrg->lo) / (yrg->hi - yrg->lo) * ph;
            fprintf(f, "%.1f,%.1f ", px, py);
        }
        fprintf(f, "\"/>\n");
        /* Sparse series (one point per epoch) get a marker per point, so a
         * single epoch still shows. */
        for (int i = 0; s->n <= 64 && i < s->n; i++) {
            if (!isfinite(s->x[i]) || !isfinite(s->y[i]))
                continue;
            double px = L + (s->x[i] - xr.lo) / (xr.hi - xr.lo) * pw;
            double py = T + ph - (s->y[i] - yrg->lo) / (yrg->hi - yrg->lo) * ph;
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"", px, py);
            xml_text(f, s->color ? s->color : "#000");
            fprintf(f, "\"><title>%g</title></circle>\n", s->y[i]);
        }
        fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" fill=\"", L + 10, T + 16 + 16.0 * k);
        xml_text(f, s->color ? s->color : "#000");
        fprintf(f, "\">");
        xml_text(f, s->name);
        fprintf(f, "</text>\n");
    }
    fprintf(f, "</svg>\n");

    int rc = 0;
    if (ferror(f))
        rc = -EIO;
    if (fclose(f) != 0 && rc == 0)
        rc = -errno;
    if (rc == 0 && rename(tmp, path) != 0)
        rc = -errno;
    if (rc != 0)
        unlink(tmp);
    return rc;
}
