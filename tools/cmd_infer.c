/* starling infer: predictions through the swarm (lands with the inference issue). */
#include <stdio.h>

#include "tools/cli.h"

static const char infer_help[] =
    "Usage: starling infer --initial-peers ADDR --model NAME (--data test | --input FILE)\n"
    "                      [--replicas K] [--json]\n"
    "\n"
    "Sends forward-only requests through the swarm while it trains and prints\n"
    "the predicted classes, accuracy (when labels are known) and latency.\n"
    "\n"
    "Options:\n"
    "  --initial-peers LIST  DHT addresses to join through\n"
    "  --model NAME          model to query, e.g. fmnist-mlp\n"
    "  --data test           use the Fashion-MNIST test set\n"
    "  --input FILE          inputs from FILE\n"
    "  --replicas K          send each input along K replica paths and vote\n"
    "  --json                print one JSON document\n"
    "  -h, --help            this text\n"
    "\n"
    "Status: not in this build yet.\n";

int cmd_infer(int argc, char **argv)
{
    static const struct option opts[] = {
        {"initial-peers", required_argument, NULL, 'i'},
        {"model", required_argument, NULL, 'm'},
        {"data", required_argument, NULL, 'd'},
        {"input", required_argument, NULL, 'f'},
        {"replicas", required_argument, NULL, 'r'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    return cli_planned("infer", infer_help, opts, argc, argv);
}
