/* starling train: train through the swarm (lands with the routing issue). */
#include <stdio.h>

#include "tools/cli.h"

static const char train_help[] =
    "Usage: starling train --initial-peers ADDR --model NAME [--epochs N] [--batch B]\n"
    "                      [--lr X] [--data DIR] [--json]\n"
    "\n"
    "Trains a model whose blocks are served by the swarm, on Fashion-MNIST\n"
    "(Debian package dataset-fashion-mnist). The trainer holds only the data\n"
    "and the loss.\n"
    "\n"
    "Options:\n"
    "  --initial-peers LIST  DHT addresses to join through\n"
    "  --model NAME          model to train, e.g. fmnist-mlp\n"
    "  --epochs N            passes over the training set\n"
    "  --batch B             samples per micro-batch\n"
    "  --lr X                learning rate\n"
    "  --data DIR            Fashion-MNIST IDX files (default: the Debian package's)\n"
    "  --json                print one final JSON line\n"
    "  -h, --help            this text\n"
    "\n"
    "Status: not in this build yet.\n";

int cmd_train(int argc, char **argv)
{
    static const struct option opts[] = {
        {"initial-peers", required_argument, NULL, 'i'},
        {"model", required_argument, NULL, 'm'},
        {"epochs", required_argument, NULL, 'e'},
        {"batch", required_argument, NULL, 'b'},
        {"lr", required_argument, NULL, 'l'},
        {"data", required_argument, NULL, 'd'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    return cli_planned("train", train_help, opts, argc, argv);
}
