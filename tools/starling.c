/* starling: one binary, one subcommand per role in the swarm. */
#include <stdio.h>
#include <string.h>

#include <pthread.h>

#include "config.h"
#include "expert/expert.h"
#include "tools/cli.h"

static const struct {
    const char *name;
    cli_main_fn run;
    const char *summary;
    const char *comm; /* the process name in ps/top (the kernel keeps 15 characters) */
} commands[] = {
    {"peer", cmd_peer, "serve model blocks to the swarm and announce them in the DHT", "starling-peer"},
    {"bootstrap", cmd_bootstrap, "run a DHT-only node that others join through", "starling-boot"},
    {"monitor", cmd_monitor, "show the models, stages and holders of a swarm", "starling-mon"},
    {"train", cmd_train, "train a model through the swarm (images or text)", "starling-train"},
    {"infer", cmd_infer, "run predictions through the swarm", "starling-infer"},
    {"generate", cmd_generate, "sample text from a language model through the swarm", "starling-gen"},
    {"export", cmd_export, "write a GPT's newest weights from the swarm as a Hugging Face model", "starling-export"},
    {"keygen", cmd_keygen, "create an ed25519 identity file and print its node ID", "starling-keygen"},
    {"dht", cmd_dht, "get or put a key in a running swarm (debugging)", "starling-dht"},
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
        if (strcmp(name, commands[i].name) == 0) {
            /* "starling-peer" etc. in ps/top (after the BLAS re-exec the
             * kernel's name for us is "exe"); threads started later inherit
             * it unless they name themselves (compute threads do). */
            (void)pthread_setname_np(pthread_self(), commands[i].comm);
            return commands[i].run(argc - 1, argv + 1);
        }
    if (name[0] == '-')
        fprintf(stderr, "starling: unknown option '%s'\n", name);
    else
        fprintf(stderr, "starling: unknown command '%s'\n", name);
    fprintf(stderr, "Try 'starling --help' for the list of commands.\n");
    return CLI_EXIT_USAGE;
}
