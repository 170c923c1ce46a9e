#!/usr/bin/env python3
"""tests/cudaemu/transform.py: turns a CUDA source (.cu) into C++ that
compiles against the emulator (emu.h).

Usage: transform.py INPUT.cu OUTPUT.cc

Rewrites, everything else is copied as it is (comments, strings and
preprocessor lines are never rewritten; line numbers are kept, and a #line
directive makes the compiler's messages and __FILE__ name the .cu file):

  kernel<<<grid, block[, smem[, stream]]>>>(args)
      -> emu_launch("kernel", __FILE__, __LINE__, BOUND, dim3(grid),
                    dim3(block), (size_t)(smem), (cudaStream_t)(stream),
                    kernel, args)
     (BOUND: the kernel's __launch_bounds__ maximum, else 1024; template
     arguments stay with the kernel's name);
  __launch_bounds__(...)                          -> removed (recorded);
  extern __shared__ T name[];                     -> T *const name = emu_dynamic_shared<T>();
  __shared__ T name[N]...;  (in a function)       -> a reference to per-block storage:
      static char emu_shared_site_K; T (&name)[N]... = *emu_static_shared<T[N]...>(&emu_shared_site_K, A);
  #pragma unroll [N]                              -> an empty line.

A __shared__ declaration at file scope, one with several declarators or an
initialiser, or a launch the script cannot parse is an error (exit 1).
"""
import os
import re
import sys


class Fail(Exception):
    pass


def code_mask(src):
    """src with comments, string and character literals, and preprocessor
    lines blanked (newlines kept), so searches only see code."""
    out = list(src)
    i, n = 0, len(src)
    line_start = True
    while i < n:
        c = src[i]
        if line_start and c in ' \t':
            i += 1
            continue
        if line_start and c == '#':
            # A directive, with its continuation lines.
            j = i
            while j < n and src[j] != '\n':
                if src[j] == '\\' and j + 1 < n and src[j + 1] == '\n':
                    j += 2
                    continue
                j += 1
            for k in range(i, j):
                if out[k] != '\n':
                    out[k] = ' '
            i = j
            continue
        line_start = False
        if src.startswith('//', i):
            j = src.find('\n', i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = ' '
            i = j
            continue
        if src.startswith('/*', i):
            j = src.find('*/', i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != '\n':
                    out[k] = ' '
            i = j
            continue
        if c in '"\'':
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == '\\' else 1
            for k in range(i + 1, min(j, n)):
                if out[k] != '\n':
                    out[k] = ' '
            i = j + 1
            continue
        if c == '\n':
            line_start = True
        i += 1
    return ''.join(out)


def line_of(src, pos):
    return src.count('\n', 0, pos) + 1


def match_paren(code, i, open_c='(', close_c=')'):
    """Index of the bracket closing the one at code[i]."""
    depth = 0
    for j in range(i, len(code)):
        if code[j] == open_c:
            depth += 1
        elif code[j] == close_c:
            depth -= 1
            if depth == 0:
                return j
    raise Fail('unbalanced %s at offset %d' % (open_c, i))


def split_top(text):
    """Splits text at commas outside (), [] and {}."""
    parts, depth, cur = [], 0, ''
    for ch in text:
        if ch in '([{':
            depth += 1
        elif ch in ')]}':
            depth -= 1
        if ch == ',' and depth == 0:
            parts.append(cur)
            cur = ''
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts]


def depth_at(code):
    """depth[i]: the brace depth before code[i]."""
    d, out = 0, [0] * (len(code) + 1)
    for i, ch in enumerate(code):
        out[i] = d
        if ch == '{':
            d += 1
        elif ch == '}':
            d -= 1
    out[len(code)] = d
    return out


IDENT = re.compile(r'[A-Za-z_]\w*')


def transform(src, path):
    code = code_mask(src)
    depth = depth_at(code)
    edits = []  # (start, end, replacement)

    def fail(pos, msg):
        raise Fail('%s:%d: %s' % (path, line_of(src, pos), msg))

    # __launch_bounds__(max[, min]) before a kernel's name.
    bounds = {}
    for m in re.finditer(r'\b__launch_bounds__\s*\(', code):
        close = match_paren(code, m.end() - 1)
        args = split_top(src[m.end():close])
        nm = re.compile(r'\b([A-Za-z_]\w*)\s*\(').search(code, close + 1)
        if not nm:
            fail(m.start(), '__launch_bounds__ without a kernel after it')
        bounds[nm.group(1)] = args[0]
        edits.append((m.start(), close + 1, ''))

    # Shared memory declarations.
    site = 0
    for m in re.finditer(r'\b__shared__\b', code):
        ext = re.compile(r'\bextern\s+$').search(code, 0, m.start())
        start = ext.start() if ext else m.start()
        semi = code.find(';', m.end())
        if semi < 0:
            fail(m.start(), '__shared__ declaration without a ;')
        decl = src[m.end():semi]
        align = None
        am = re.search(r'__align__\s*\(([^)]*)\)', decl)
        if am:
            align = am.group(1).strip()
            decl = decl[:am.start()] + decl[am.end():]
        decl = re.sub(r'\bstatic\b', '', decl).strip()
        if len(split_top(decl)) != 1:
            fail(m.start(), 'a __shared__ declaration with several declarators: split it')
        if '=' in decl:
            fail(m.start(), 'a __shared__ declaration with an initialiser (CUDA has none)')
        dm = re.match(r'^(?P<type>.*?)\b(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(\[[^\]]*\]\s*)*)$',
                      decl, re.S)
        if not dm or not dm.group('type').strip():
            fail(m.start(), 'cannot parse the __shared__ declaration "%s"' % decl)
        typ, name = ' '.join(dm.group('type').split()), dm.group('name')
        dims = ''.join(dm.group('dims').split())
        if ext:
            if dims != '[]':
                fail(m.start(), 'extern __shared__ must be an array of unknown size')
            rep = '%s *const %s = emu_dynamic_shared<%s>();' % (typ, name, typ)
        else:
            if depth[m.start()] == 0:
                fail(m.start(), '__shared__ at file scope is not supported (declare it in the kernel)')
            key = 'emu_shared_site_%d' % site
            site += 1
            a = ', %s' % align if align else ''
            if dims:
                rep = 'static char %s; %s (&%s)%s = *emu_static_shared<%s%s>(&%s%s);' % (
                    key, typ, name, dims, typ, dims, key, a)
            else:
                rep = 'static char %s; %s &%s = *emu_static_shared<%s>(&%s%s);' % (
                    key, typ, name, typ, key, a)
        edits.append((start, semi + 1, rep))

    # Launches.
    for m in re.finditer(r'<<<', code):
        k = m.start()
        e = k
        while e > 0 and code[e - 1].isspace():
            e -= 1
        s = e
        if s > 0 and code[s - 1] == '>':
            d = 0
            s -= 1
            while s >= 0:
                if code[s] == '>':
                    d += 1
                elif code[s] == '<':
                    d -= 1
                    if d == 0:
                        break
                s -= 1
            if s < 0:
                fail(k, 'cannot find the template arguments of the launched kernel')
        while s > 0 and (code[s - 1].isalnum() or code[s - 1] in '_:'):
            s -= 1
        name = ' '.join(src[s:e].split())
        base = IDENT.match(name.split('::')[-1]) if name else None
        if not base:
            fail(k, 'cannot find the name of the launched kernel')
        c_end = code.find('>>>', k + 3)
        if c_end < 0:
            fail(k, '<<< without >>>')
        cfg = split_top(src[k + 3:c_end])
        if not 2 <= len(cfg) <= 4:
            fail(k, 'a launch configuration has 2 to 4 parts, not %d' % len(cfg))
        cfg += ['0'] * (4 - len(cfg))
        a0 = c_end + 3
        while a0 < len(code) and code[a0].isspace():
            a0 += 1
        if a0 >= len(code) or code[a0] != '(':
            fail(k, 'a launch without its argument list')
        a1 = match_paren(code, a0)
        args = src[a0 + 1:a1].strip()
        rep = 'emu_launch("%s", __FILE__, __LINE__, (int)(%s), dim3(%s), dim3(%s), (size_t)(%s), (cudaStream_t)(%s), %s%s)' % (
            name, bounds.get(base.group(0), '1024'), cfg[0], cfg[1], cfg[2], cfg[3], name,
            ', ' + args if args else '')
        edits.append((s, a1 + 1, rep))

    # #pragma unroll: GCC does not know it.
    for m in re.finditer(r'(?m)^[ \t]*#[ \t]*pragma[ \t]+unroll\b[^\n]*', src):
        edits.append((m.start(), m.end(), ''))

    edits.sort()
    for a, b in zip(edits, edits[1:]):
        if a[1] > b[0]:
            fail(b[0], 'overlapping rewrites (a launch inside a launch?)')
    out, pos = [], 0
    for a, b, rep in edits:
        out.append(src[pos:a])
        pad = src.count('\n', a, b) - rep.count('\n')  # keep the line numbers
        if pad < 0:
            fail(a, 'a rewrite would add lines')
        out.append(rep + '\n' * pad)
        pos = b
    out.append(src[pos:])
    return ''.join(out)


def main():
    if len(sys.argv) != 3:
        sys.stderr.write('usage: transform.py INPUT.cu OUTPUT.cc\n')
        return 2
    inp, outp = sys.argv[1], sys.argv[2]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.relpath(os.path.abspath(inp), root)
    with open(inp, encoding='utf-8') as f:
        src = f.read()
    try:
        body = transform(src, path)
    except Fail as e:
        sys.stderr.write('transform.py: %s\n' % e)
        return 1
    text = ('// Generated by tests/cudaemu/transform.py from %s: do not edit.\n'
            '#include "emu.h"\n#line 1 "%s"\n' % (path, path)) + body
    tmp = outp + '.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
        f.write(text)
    os.replace(tmp, outp)
    return 0


if __name__ == '__main__':
    sys.exit(main())
