/* starling keygen: create (or inspect) an ed25519 identity file. */
#include <stdio.h>
#include <string.h>

#include "dht/dht.h"
#include "tools/cli.h"

#include <sodium.h>

static const char keygen_help[] =
    "Usage: starling keygen --out FILE [--force]\n"
    "       starling keygen --show FILE\n"
    "\n"
    "Creates an ed25519 identity (libsodium) and writes it to FILE with mode 0600,\n"
    "then prints the node ID: the BLAKE2b-160 hash of the public key, as 40 hex\n"
    "digits. Peers and bootstrap nodes take the file with --identity FILE, so\n"
    "their node ID stays the same across restarts.\n"
    "\n"
    "Options:\n"
    "  -o, --out FILE    write a new identity to FILE (refuses to replace one)\n"
    "  -f, --force       with --out: replace an existing FILE\n"
    "  -s, --show FILE   load an existing identity and print its node ID\n"
    "  -h, --help        this text\n"
    "\n"
    "Exit status: 0 on success, 1 if the file cannot be written or read\n"
    "(exists, corrupt, readable by others), 2 on usage errors.\n";

int cmd_keygen(int argc, char **argv)
{
    static const struct option opts[] = {
        {"out", required_argument, NULL, 'o'},
        {"force", no_argument, NULL, 'f'},
        {"show", required_argument, NULL, 's'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *out = NULL, *show = NULL;
    int force = 0, c, rc;
    dht_identity ident;
    char hex[DHT_ID_HEX_LEN + 1];

    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":o:fs:h", opts, NULL)) != -1) {
        switch (c) {
        case 'o': out = optarg; break;
        case 'f': force = 1; break;
        case 's': show = optarg; break;
        case 'h': fputs(keygen_help, stdout); return CLI_EXIT_OK;
        default: return cli_bad_option("keygen", c, argv);
        }
    }
    if (cli_no_positional("keygen", argc, argv))
        return CLI_EXIT_USAGE;
    if (!out == !show)
        return cli_usage_error("keygen", "give exactly one of --out FILE or --show FILE");
    if (force && !out)
        return cli_usage_error("keygen", "--force only goes with --out");

    if (show) {
        rc = dht_identity_load(&ident, show);
        if (rc != 0)
            return cli_fail("keygen", "cannot load identity '%s': %s", show, dht_identity_strerror(rc));
    } else {
        rc = dht_identity_generate(&ident);
        if (rc == 0)
            rc = dht_identity_save(&ident, out, force);
        if (rc != 0) {
            sodium_memzero(&ident, sizeof ident);
            return cli_fail("keygen", "cannot write identity '%s': %s", out, dht_identity_strerror(rc));
        }
    }
    dht_id_to_hex(hex, ident.id);
    sodium_memzero(&ident, sizeof ident);
    printf("%s\n", hex);
    return CLI_EXIT_OK;
}
