/* tools/cli.h: helpers shared by the `starling` subcommands.
 *
 * Conventions: exit 0 on success, 1 on a runtime failure, 2 on a usage error
 * (unknown subcommand or flag, missing or malformed value). Messages go to
 * stderr as "starling CMD: what went wrong".
 */
#ifndef TOOLS_CLI_H
#define TOOLS_CLI_H

#include <getopt.h>
#include <stdarg.h>

#define CLI_EXIT_OK 0
#define CLI_EXIT_FAIL 1
#define CLI_EXIT_USAGE 2

typedef int (*cli_main_fn)(int argc, char **argv);

/* Prints "starling CMD: MESSAGE" and a hint to run --help; returns 2. */
int cli_usage_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Prints "starling CMD: MESSAGE"; returns 1. */
int cli_fail(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Explains the option getopt_long just rejected (it returned '?' or ':').
 * optstring must start with ':' so a missing value is reported as ':'.
 * Returns 2. */
int cli_bad_option(const char *cmd, int c, char **argv);

/* Rejects positional arguments left after getopt_long; returns 0 or 2. */
int cli_no_positional(const char *cmd, int argc, char **argv);

/* Parses an integer flag value in [min, max]. Returns 0, or prints a clear
 * error and returns 2. */
int cli_parse_long(const char *cmd, const char *flag, const char *val, long min, long max,
                   long *out);

/* Parses a finite floating-point flag value in [min, max]. Returns 0 or 2. */
int cli_parse_double(const char *cmd, const char *flag, const char *val, double min,
                     double max, double *out);

struct expert_model_spec;

/* The model a command works on, from --model NAME (NULL when not given) and
 * --model-file FILE (NULL when not given). With FILE: loads the model file
 * (docs/models.md), registers its model (expert_model_register) and selects
 * it; NAME, when given too, must be the file's model name. Without FILE: the
 * model called NAME, or dflt when NAME is NULL (*out = NULL when dflt is
 * NULL too). Returns 0 with *out set, or prints why ("starling CMD: ...",
 * naming the file and the key at fault, or listing the known models) and
 * returns 2. */
int cli_model_select(const char *cmd, const char *name, const char *file, const char *dflt,
                     const struct expert_model_spec **out);

/* Subcommands. Each takes argv with argv[0] = the subcommand's name. */
int cmd_peer(int argc, char **argv);
int cmd_bootstrap(int argc, char **argv);
int cmd_monitor(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_infer(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_keygen(int argc, char **argv);
int cmd_dht(int argc, char **argv);
int cmd_export(int argc, char **argv);

#endif
