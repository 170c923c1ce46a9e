/* starling keygen: create (or inspect) an ed25519 identity file. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

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
    "their node ID stays the same across restarts. Missing parent directories of\n"
    "FILE are created with mode 0700 (only the missing ones; existing ones are\n"
    "left as they are), so --out ~/.starling/identity.key works on a fresh machine.\n"
    "\n"
    "Options:\n"
    "  -o, --out FILE    write a new identity to FILE (refuses to replace one)\n"
    "  -f, --force       with --out: replace an existing FILE\n"
    "  -s, --show FILE   load an existing identity and print its node ID\n"
    "  -h, --help        this text\n"
    "\n"
    "Exit status: 0 on success, 1 if the file cannot be written or read\n"
    "(exists, corrupt, readable by others), 2 on usage errors.\n";

/* Creates the missing parent directories of path, each with mode 0700;
 * existing ones are left alone. Returns 0 or -errno, with the directory that
 * failed in dir (cap bytes). */
static int make_parents(const char *path, char *dir, size_t cap)
{
    size_t len = strlen(path);
    if (len >= cap) {
        snprintf(dir, cap, "%s", "(too long)");
        return -ENAMETOOLONG;
    }
    memcpy(dir, path, len + 1);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir)
        return 0; /* in the current directory, or directly under / */
    *slash = '\0';
    /* Each prefix ending before a '/', shortest first ("a", "a/b", ...). */
    for (char *p = dir + 1;; p++) {
        if (*p != '/' && *p != '\0')
            continue;
        char saved = *p;
        *p = '\0';
        if (mkdir(dir, 0700) == 0) {
            if (chmod(dir, 0700) != 0) /* whatever the umask took away */
                return -errno;
        } else if (errno != EEXIST) {
            return -errno;
        }
        if (saved == '\0')
            return 0;
        *p = saved;
    }
}

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
        char dir[4096];
        rc = make_parents(out, dir, sizeof dir);
        if (rc != 0)
            return cli_fail("keygen", "cannot create directory '%s' for '%s': %s", dir, out, strerror(-rc));
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
