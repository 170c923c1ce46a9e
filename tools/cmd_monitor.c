/* starling monitor: the operator's view of a swarm (lands with the monitor issue). */
#include <stdio.h>

#include "tools/cli.h"

static const char monitor_help[] =
    "Usage: starling monitor --initial-peers ADDR [--model NAME] [--watch SECONDS] [--json]\n"
    "\n"
    "Joins the DHT as a light client and lists the models announced in the swarm,\n"
    "each stage's holders, their state, throughput and load.\n"
    "\n"
    "Options:\n"
    "  --initial-peers LIST  DHT addresses to join through\n"
    "  --model NAME          show only this model\n"
    "  --watch SECONDS       redraw every SECONDS until interrupted\n"
    "  --json                print one JSON document\n"
    "  -h, --help            this text\n"
    "\n"
    "Exit status: 0 every stage covered, 1 a stage has no holder, 2 usage or\n"
    "connection error.\n"
    "\n"
    "Status: not in this build yet.\n";

int cmd_monitor(int argc, char **argv)
{
    static const struct option opts[] = {
        {"initial-peers", required_argument, NULL, 'i'},
        {"model", required_argument, NULL, 'm'},
        {"watch", required_argument, NULL, 'w'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    return cli_planned("monitor", monitor_help, opts, argc, argv);
}
