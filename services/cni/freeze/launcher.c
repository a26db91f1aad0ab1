/*
 * cilia-cni launcher: the executable of the frozen plugin (services/cni/freeze/build.py).
 *
 * It starts the bundle's CPython in this process and runs the plugin's main(), exactly as
 * `python3 -I -S -c 'from cilia_cni.__main__ import main; main()' ARGS` would, with the
 * interpreter, its standard library and the plugin taken from the support directory
 * `<dir of this executable>/.cilia-cni/` (PyInstaller collects it). Nothing else runs
 * before the plugin: PyInstaller's own bootloader, which this replaces, re-executes
 * itself once per start on Linux (to put the support directory on LD_LIBRARY_PATH) and
 * runs its Python bootstrap (an importer of its own and run-time hooks) before the
 * plugin; that was ~4 ms CPU of the ~20 ms of every exec (build.py's docstring).
 *
 * This file's own path comes from /proc/self/exe, or, where /proc is not mounted (a bare
 * chroot), from argv[0] (resolved with realpath(3); a bare name is looked up in PATH), so a
 * symlink to it works. libpython3.11.so.1.0 is dlopen(3)ed from the support directory by
 * that absolute path (RTLD_GLOBAL: extension modules resolve the C API from it), so
 * loading it needs no search path at all. The bundle's other libraries (libz for zlib and
 * binascii, libcrypto for _hashlib ...) are found through this file's RPATH
 * `$ORIGIN/.cilia-cni` (DT_RPATH, which, unlike DT_RUNPATH, also applies to what dlopen'ed
 * objects link); the dynamic loader expands $ORIGIN through /proc, so without /proc those
 * come from the host (the modules the plugin imports at run time link only libc and libm).
 *
 * Interpreter settings (CPython's PyConfig, docs.python.org/3.11/c-api/init_config.html):
 * isolated (no PYTHON* variable, no user site, no script directory on sys.path), no `site`,
 * no bytecode written, sys.path = the support directory and its python3.11/lib-dynload
 * only, sys.argv = this process's argv; locale handling as `python3 -I` (a C locale is
 * coerced to UTF-8, PEP 538/540), so the plugin's JSON is written alike.
 *
 * A stdin that is a directory is closed and the plugin gets --stdin-is-a-directory (see
 * main()), so such a start is the plugin's spec error too.
 *
 * Exit status: the plugin's; 1 with a CNI spec error JSON (code 999) on stdout when the
 * interpreter cannot start (a damaged bundle), like any other plugin failure.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <limits.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SUPPORT_DIR ".cilia-cni"
#define LIBPYTHON "libpython3.11.so.1.0"
#define DYNLOAD_DIR "python3.11/lib-dynload"

static const wchar_t RUN[] = L"from cilia_cni.__main__ import main; main()";

/* The C API, from the dlopen'ed libpython. */
static struct {
    void (*config_init)(PyConfig *);
    void (*config_clear)(PyConfig *);
    PyStatus (*set_bytes_argv)(PyConfig *, Py_ssize_t, char *const *);
    PyStatus (*set_bytes_string)(PyConfig *, wchar_t **, const char *);
    PyStatus (*set_string)(PyConfig *, wchar_t **, const wchar_t *);
    PyStatus (*list_append)(PyWideStringList *, const wchar_t *);
    wchar_t *(*decode_locale)(const char *, size_t *);
    void (*raw_free)(void *);
    PyStatus (*initialize)(const PyConfig *);
    int (*run_main)(void);
} py;

/* PyStatus_Exception() without linking libpython: an error or an exit request. */
static int
failed(PyStatus status)
{
    return status._type != _PyStatus_TYPE_OK;
}

static int
cannot_start(const char *why, const char *detail)
{
    /* The CNI spec's error shape (plugin code 999: "unknown"), so the runtime logs why. */
    printf("{\"cniVersion\": \"1.1.0\", \"code\": 999, \"msg\": \"cilia-cni cannot start its "
           "interpreter: %s\", \"details\": \"", why);
    for (; detail != NULL && *detail; detail++) {
        if (*detail == '"' || *detail == '\\') {
            putchar('\\');
        }
        putchar((unsigned char)*detail < 0x20 ? ' ' : *detail);
    }
    printf("\"}\n");
    fflush(stdout);
    return 1;
}

/* The directory of this executable into dir (PATH_MAX bytes); -1 when unknown. */
static int
own_dir(const char *argv0, char *dir)
{
    char found[PATH_MAX];
    char *slash;
    ssize_t n = readlink("/proc/self/exe", dir, PATH_MAX - 1);

    if (n > 0) {
        dir[n] = '\0';
    } else if (argv0 != NULL && strchr(argv0, '/') != NULL) {
        if (realpath(argv0, dir) == NULL) {
            return -1;
        }
    } else {
        const char *path = getenv("PATH");
        const char *end;
        int len;

        if (argv0 == NULL || path == NULL) {
            return -1;
        }
        for (;; path = end + 1) {
            end = strchrnul(path, ':');
            len = snprintf(found, sizeof(found), "%.*s/%s", (int)(end - path),
                           end == path ? "." : path, argv0);
            if (len > 0 && len < (int)sizeof(found) && access(found, X_OK) == 0 &&
                realpath(found, dir) != NULL) {
                break;
            }
            if (*end == '\0') {
                return -1;
            }
        }
    }
    slash = strrchr(dir, '/');
    if (slash == NULL) {
        return -1;
    }
    *slash = '\0';
    return 0;
}

static int
load_python(const char *home)
{
    char path[PATH_MAX];
    void *lib;

    if (snprintf(path, sizeof(path), "%s/%s", home, LIBPYTHON) >= (int)sizeof(path)) {
        return cannot_start("the path of the executable is too long", home);
    }
    lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (lib == NULL) {
        return cannot_start("the bundle's libpython does not load", dlerror());
    }
#define SYM(field, name)                                          \
    if ((*(void **)&py.field = dlsym(lib, name)) == NULL) {       \
        return cannot_start("libpython lacks a function", name);  \
    }
    SYM(config_init, "PyConfig_InitPythonConfig");
    SYM(config_clear, "PyConfig_Clear");
    SYM(set_bytes_argv, "PyConfig_SetBytesArgv");
    SYM(set_bytes_string, "PyConfig_SetBytesString");
    SYM(set_string, "PyConfig_SetString");
    SYM(list_append, "PyWideStringList_Append");
    SYM(decode_locale, "Py_DecodeLocale");
    SYM(raw_free, "PyMem_RawFree");
    SYM(initialize, "Py_InitializeFromConfig");
    SYM(run_main, "Py_RunMain");
#undef SYM
    return 0;
}

static int
append_path(PyConfig *config, const char *dir, const char *sub)
{
    char path[PATH_MAX];
    wchar_t *wide;
    PyStatus status;

    if (snprintf(path, sizeof(path), "%s/%s", dir, sub) >= (int)sizeof(path)) {
        return -1;
    }
    wide = py.decode_locale(path, NULL);
    if (wide == NULL) {
        return -1;
    }
    status = py.list_append(&config->module_search_paths, wide);
    py.raw_free(wide);
    return failed(status) ? -1 : 0;
}

int
main(int argc, char **argv)
{
    char dir[PATH_MAX];
    char home[PATH_MAX];
    char *dir_argv[3];
    struct stat in;
    PyConfig config;
    PyStatus status;

    /* CPython aborts before any plugin code runs when stdin is a directory ("init_sys_streams:
     * <stdin> is a directory"): start it with stdin closed and --stdin-is-a-directory, as the
     * host wrapper of cilia-cni-install does, so the plugin answers with the spec error (code
     * 5) whichever way it is started. */
    if (fstat(0, &in) == 0 && S_ISDIR(in.st_mode)) {
        close(0);
        dir_argv[0] = argc > 0 ? argv[0] : "cilia-cni";
        dir_argv[1] = "--stdin-is-a-directory";
        dir_argv[2] = NULL;
        argc = 2;
        argv = dir_argv;
    }
    if (own_dir(argc > 0 ? argv[0] : NULL, dir) < 0) {
        return cannot_start("it cannot find its own path (/proc/self/exe, argv[0])", NULL);
    }
    if (snprintf(home, sizeof(home), "%s/%s", dir, SUPPORT_DIR) >= (int)sizeof(home)) {
        return cannot_start("the path of the executable is too long", dir);
    }
    if (load_python(home) != 0) {
        return 1;
    }

    py.config_init(&config);
    config.isolated = 1;
    config.use_environment = 0;
    config.user_site_directory = 0;
    config.safe_path = 1;
    config.site_import = 0;
    config.write_bytecode = 0;
    config.parse_argv = 0;
    config.pathconfig_warnings = 0;

    status = py.set_bytes_argv(&config, argc, argv);
    if (failed(status)) {
        goto fail;
    }
    status = py.set_bytes_string(&config, &config.home, home);
    if (failed(status)) {
        goto fail;
    }
    config.module_search_paths_set = 1;
    if (append_path(&config, dir, SUPPORT_DIR) < 0 ||
        append_path(&config, home, DYNLOAD_DIR) < 0) {
        py.config_clear(&config);
        return cannot_start("the support directory's path cannot be decoded", home);
    }
    status = py.set_string(&config, &config.run_command, RUN);
    if (failed(status)) {
        goto fail;
    }
    status = py.initialize(&config);
    if (failed(status)) {
        goto fail;
    }
    py.config_clear(&config);
    return py.run_main();

fail:
    py.config_clear(&config);
    if (status._type == _PyStatus_TYPE_EXIT) {
        return status.exitcode;
    }
    return cannot_start("its initialization failed", status.err_msg);
}
