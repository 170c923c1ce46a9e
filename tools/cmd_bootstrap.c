/* starling bootstrap: a DHT-only node (lands with the DHT issue). */
#include <stdio.h>

#include "tools/cli.h"

static const char bootstrap_help[] =
    "Usage: starling bootstrap --listen HOST:PORT [--identity FILE] [--swarm-key FILE]\n"
    "\n"
    "Runs a DHT-only node and prints the address string that peers, trainers and\n"
    "monitors pass to --initial-peers.\n"
    "\n"
    "Options:\n"
    "  --listen HOST:PORT  UDP address to listen on\n"
    "  --identity FILE     ed25519 identity from 'starling keygen'\n"
    "  --swarm-key FILE    pre-shared key of a private swarm\n"
    "  -h, --help          this text\n"
    "\n"
    "Status: not in this build yet.\n";

int cmd_bootstrap(int argc, char **argv)
{
    static const struct option opts[] = {
        {"listen", required_argument, NULL, 'l'},
        {"identity", required_argument, NULL, 'I'},
        {"swarm-key", required_argument, NULL, 'k'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    return cli_planned("bootstrap", bootstrap_help, opts, argc, argv);
}
