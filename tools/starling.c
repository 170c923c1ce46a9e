/* starling: one binary, one subcommand per role in the swarm. */
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "expert/expert.h"
#include "tools/cli.h"

static const struct {
    const char *name;
    cli_main_fn run;
    const char *summary;
} commands[] = {
    {"peer", cmd_peer, "serve model blocks to the swarm and announce them in the DHT"},
    {"bootstrap", cmd_bootstrap, "run a DHT-only node that others join through"},
    {"monitor", cmd_monitor, "show the models, stages and holders of a swarm"},
    {"train", cmd_train, "train a model through the swarm on Fashion-MNIST"},
    {"infer", cmd_infer, "run predictions through the swarm"},
    {"keygen", cmd_keygen, "create an ed25519 identity file and print its node ID"},
    {"dht", cmd_dht, "get or put a key in a running swarm (debugging)"},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: starling COMMAND [OPTIONS]\n"
            "\n"
            "Starling trains neural networks on a swarm of peers that find each other\n"
            "through a Kademlia DHT.\n"
            "\n"
            "Commands:\n");
    for (size_t i = 0; i < NCOMMANDS; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].summary);
    fprintf(f,
            "\n"
            "Run 'starling COMMAND --help' for a command's options.\n"
            "Options: -h, --help   this text;  --version   print the version.\n");
}

int main(int argc, char **argv)
{
    expert_blas_prefer_native(argv);

    if (argc < 2) {
        usage(stderr);
        return CLI_EXIT_USAGE;
    }
    const char *name = argv[1];
    if (strcmp(name, "-h") == 0 || strcmp(name, "--help") == 0 || strcmp(name, "help") == 0) {
        usage(stdout);
        return CLI_EXIT_OK;
    }
    if (strcmp(name, "--version") == 0 || strcmp(name, "version") == 0) {
        printf("starling %s (CUDA backend: %s)\n", STARLING_VERSION, HAVE_CUDA ? "built" : "not built");
        return CLI_EXIT_OK;
    }
    for (size_t i = 0; i < NCOMMANDS; i++)
        if (strcmp(name, commands[i].name) == 0)
            return commands[i].run(argc - 1, argv + 1);
    if (name[0] == '-')
        fprintf(stderr, "starling: unknown option '%s'\n", name);
    else
        fprintf(stderr, "starling: unknown command '%s'\n", name);
    fprintf(stderr, "Try 'starling --help' for the list of commands.\n");
    return CLI_EXIT_USAGE;
}
