/* starling peer: the daemon that hosts blocks. The server lands with the peer
 * issue; until then the command checks its flags and the device. */
#include <errno.h>
#include <stdio.h>

#include "peer/peer.h"
#include "tools/cli.h"

static const char peer_help[] =
    "Usage: starling peer --initial-peers ADDR[,ADDR...] --model NAME --blocks I[,J...]\n"
    "                     [--device cpu|cuda:N] [--listen HOST:PORT] [--identity FILE]\n"
    "                     [--checkpoint-dir DIR] [--swarm-key FILE]\n"
    "\n"
    "Hosts model blocks, serves forward/backward requests over the tensor RPC\n"
    "and announces the blocks in the DHT.\n"
    "\n"
    "Options:\n"
    "  --initial-peers LIST  DHT addresses to join through (from 'starling bootstrap')\n"
    "  --model NAME          model to serve, e.g. fmnist-mlp\n"
    "  --blocks LIST         stage indices to host, e.g. 1,2\n"
    "  --device DEV          cpu (default), cuda or cuda:N\n"
    "  --listen HOST:PORT    address for the tensor RPC and the DHT\n"
    "  --identity FILE       ed25519 identity from 'starling keygen'\n"
    "  --checkpoint-dir DIR  where to keep checkpoints of the hosted blocks\n"
    "  --swarm-key FILE      pre-shared key of a private swarm\n"
    "  -h, --help            this text\n"
    "\n"
    "Status: the serving daemon is not in this build yet; only the flags and the\n"
    "device are checked.\n";

int cmd_peer(int argc, char **argv)
{
    static const struct option opts[] = {
        {"initial-peers", required_argument, NULL, 'i'},
        {"model", required_argument, NULL, 'm'},
        {"blocks", required_argument, NULL, 'b'},
        {"device", required_argument, NULL, 'd'},
        {"listen", required_argument, NULL, 'l'},
        {"identity", required_argument, NULL, 'I'},
        {"checkpoint-dir", required_argument, NULL, 'c'},
        {"swarm-key", required_argument, NULL, 'k'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *device = "cpu";
    char err[256];
    peer_device dev;
    int c;

    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        switch (c) {
        case 'h': fputs(peer_help, stdout); return CLI_EXIT_OK;
        case 'd': device = optarg; break;
        case 'i': case 'm': case 'b': case 'l': case 'I': case 'c': case 'k': break;
        default: return cli_bad_option("peer", c, argv);
        }
    }
    if (cli_no_positional("peer", argc, argv))
        return CLI_EXIT_USAGE;
    int rc = peer_device_parse(device, &dev, err, sizeof err);
    if (rc == -EINVAL)
        return cli_usage_error("peer", "%s", err);
    if (rc != 0)
        return cli_fail("peer", "%s", err);
    return cli_fail("peer", "the serving daemon is not available in this build yet (device %s is usable)",
                    dev.desc);
}
