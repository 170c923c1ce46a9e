#include "tools/cli.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "expert/model.h"
#include "expert/modelfile.h"

static void vsay(const char *cmd, const char *fmt, va_list ap)
{
    fprintf(stderr, "starling %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
}

int cli_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsay(cmd, fmt, ap);
    va_end(ap);
    fprintf(stderr, "Try 'starling %s --help'.\n", cmd);
    return CLI_EXIT_USAGE;
}

int cli_fail(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsay(cmd, fmt, ap);
    va_end(ap);
    return CLI_EXIT_FAIL;
}

int cli_bad_option(const char *cmd, int c, char **argv)
{
    /* getopt_long leaves optind just past the offending word. */
    const char *word = optind > 0 ? argv[optind - 1] : "?";
    if (c == ':')
        return cli_usage_error(cmd, "option '%s' needs a value", word);
    if (optopt && optopt != '?' && strncmp(word, "--", 2) != 0)
        return cli_usage_error(cmd, "unknown option '-%c'", optopt);
    return cli_usage_error(cmd, "unknown option '%s'", word);
}

int cli_no_positional(const char *cmd, int argc, char **argv)
{
    if (optind < argc)
        return cli_usage_error(cmd, "unexpected argument '%s'", argv[optind]);
    return 0;
}

int cli_parse_long(const char *cmd, const char *flag, const char *val, long min, long max,
                   long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(val, &end, 10);
    if (errno || end == val || *end)
        return cli_usage_error(cmd, "%s expects an integer, got '%s'", flag, val);
    if (v < min || v > max)
        return cli_usage_error(cmd, "%s must be between %ld and %ld, got %ld", flag, min, max, v);
    *out = v;
    return 0;
}

int cli_parse_double(const char *cmd, const char *flag, const char *val, double min,
                     double max, double *out)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(val, &end);
    if (errno || end == val || *end || !isfinite(v))
        return cli_usage_error(cmd, "%s expects a number, got '%s'", flag, val);
    if (v < min || v > max)
        return cli_usage_error(cmd, "%s must be between %g and %g, got %g", flag, min, max, v);
    *out = v;
    return 0;
}

int cli_model_select(const char *cmd, const char *name, const char *file, const char *dflt,
                     const struct expert_model_spec **out)
{
    *out = NULL;
    if (file) {
        char err[512], fname[EXPERT_MODEL_NAME_MAX + 1];
        struct expert_model_spec *m = expert_model_load_file(file, err, sizeof err);
        if (!m)
            return cli_usage_error(cmd, "model file %s", err);
        snprintf(fname, sizeof fname, "%s", m->name);
        if (name && strcmp(name, fname) != 0) {
            expert_model_free(m);
            return cli_usage_error(cmd, "--model '%s' is not the model in %s ('%s'); give one of them, "
                                   "or the same name", name, file, fname);
        }
        if (expert_model_register(m, err, sizeof err) < 0) /* takes m */
            return cli_usage_error(cmd, "model file %s: %s", file, err);
        *out = expert_model_find(fname);
        return *out ? 0 : cli_usage_error(cmd, "model file %s: not registered", file);
    }
    if (!name && !dflt)
        return 0;
    *out = expert_model_find(name ? name : dflt);
    if (*out)
        return 0;
    char names[512] = "";
    for (int i = 0; expert_model_at(i); i++)
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "",
                 expert_model_at(i)->name);
    return cli_usage_error(cmd, "unknown model '%s' (known: %s; or give --model-file FILE)",
                           name ? name : dflt, names);
}
