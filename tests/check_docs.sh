#!/bin/sh
# The user-facing docs (README.md, moept.h, docs/*.md) against what they must
# not say again. One "ok/FAIL" line a check, the offending lines under a FAIL:
# - every relative link [..](file#anchor) resolves to a file and, with an
#   anchor, to a heading of that file (GitHub's anchor rule); every
#   docs/X.md "Heading" reference names a heading of X;
# - no issue numbers ("#14", "issue 13"; another project's issue, written
#   "NAME's issue N", is a citation a user can follow) and no "session";
# - the claims found false in the code stay gone: router_jitter_noise "not
#   read" by moept_config_from_hf; "every reference case passes at --ep"
#   (cases whose E does not split are skipped); moe_layer_freq unexplained;
# - one link line, `cc your.o moept.o -lm -pthread`, in README.md and moept.h,
#   and no other "link with" line; every README mpirun of build/train_mpi
#   carries --oversubscribe (2-core machines refuse -np 4 without it).
# - every dated measurement lives in docs/PERF.md (test-run times in
#   docs/TESTING.md): no date (YYYY-MM-DD) in the other docs or in moept.h's
#   top comment, but in a README paragraph that quotes `make run`'s or
#   `make test`'s time and links to PERF.md or TESTING.md; no sentence
#   outside TESTING.md (and that README paragraph) times a test run (`make
#   test`, `make check`, CI's run, "N passed").
# - every measured figure lives in docs/PERF.md or docs/TESTING.md, with its
#   command, date and machine. A figure is a number with a unit of time (ns,
#   µs, ms, s, min), of size (KiB, MB, GB, ...) or of rate (TFLOP/s, GB/s,
#   tokens/s, ...), or a ratio (2.4x, 2.4×; 8 x 65535 and 1 × 128 are
#   products). It is a measured one when its sentence says a run gave it:
#   measured, faster, slower, speed-up, median, best of, fastest, slowest,
#   wall clock, CPU time, resident (RSS, high-water: a process's memory),
#   "took/takes/ran/runs/reached/came to" right before a number, "on the
#   H200" (a GPU, a CPU, "this machine", N cores), or the figure is in
#   tokens/s. Configuration values (T 8192, a 64 MiB limit), sizes a formula
#   gives, tolerances (1e-5), timeouts, data-sheet rates and the cost
#   models' times say none of that and pass. Outside PERF.md and TESTING.md
#   (scanned: every other tracked markdown file, README.md and docs/*.md,
#   and moept.h's top comment) a measured figure passes only in code (fenced
#   or indented blocks, `inline`), in a paragraph (a list item and a table
#   row are each one) that links to docs/PERF.md or docs/TESTING.md, where
#   it is dated, or in a section of the list below (check 7), each with its
#   reason (an entry whose heading is gone fails). CHANGELOG.md is history
#   and keeps the figures of its day.
# usage: sh tests/check_docs.sh (from the repository root)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moept_docs.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
docs="README.md $(ls docs/*.md)"
status=0
report() { # name, file of offending lines (empty: ok)
    if [ -s "$2" ]; then echo "FAIL - $1"; sed 's/^/    /' "$2"; status=1; else echo "ok - $1"; fi
}
# a file's headings as GitHub anchors (outside fenced code), one a line
anchors() {
    awk '/^```/ { code = !code; next }
         !code && /^#+ / {
             h = $0; sub(/^#+ +/, "", h); h = tolower(h)
             gsub(/[^a-z0-9 _-]/, "", h); gsub(/ /, "-", h)
             n = seen[h]++; print (n ? h "-" n : h)
         }' "$1"
}
# a file's text with each paragraph on one line (claims wrap across lines)
joined() { awk 'NF == 0 { if (p != "") print p; p = ""; next } { sub(/^[ \t*\/]+/, ""); p = p " " $0 }
                END { if (p != "") print p }' "$1"; }

# 1. relative links and their anchors
: >"$tmp/bad"
for f in $docs; do
    awk '/^```/ { code = !code; next }
         !code {
             s = $0
             while (match(s, /\]\([^) ]+\)/)) {
                 t = substr(s, RSTART + 2, RLENGTH - 3); s = substr(s, RSTART + RLENGTH)
                 if (t !~ /^[a-z]+:/) print FNR "\t" t
             }
         }' "$f" >"$tmp/links"
    while IFS="$(printf '\t')" read -r line target; do
        path=${target%%#*}
        anchor=
        case $target in *"#"*) anchor=${target#*#} ;; esac
        if [ -z "$path" ]; then dest=$f; else dest=$(dirname "$f")/$path; fi
        if [ ! -e "$dest" ]; then
            echo "$f:$line: ($target): no file $dest" >>"$tmp/bad"
        elif [ -n "$anchor" ] && ! anchors "$dest" | grep -qxF "$anchor"; then
            echo "$f:$line: ($target): no heading with anchor #$anchor in $dest" >>"$tmp/bad"
        fi
    done <"$tmp/links"
done
report "relative links and #anchors in README.md and docs/*.md resolve" "$tmp/bad"

# 2. docs/X.md "Heading" references (prose and comments) name a heading of X
: >"$tmp/bad"
for f in $docs moept.h moept.c; do
    joined "$f" | grep -oE '(docs/)?[A-Z_]+\.md,? "[^"]+"' | while read -r ref; do
        file=docs/$(echo "$ref" | sed -E 's/^(docs\/)?([A-Z_]+\.md).*/\2/')
        head=$(echo "$ref" | sed -E 's/^[^"]*"([^"]+)"$/\1/')
        [ -f "$file" ] || { echo "$f: $ref: no file $file" >>"$tmp/bad"; continue; }
        grep -qE "^#+ $(printf '%s' "$head" | sed 's/[][\.*^$()+?{}|]/\\&/g')\$" "$file" ||
            echo "$f: $ref: no heading \"$head\" in $file" >>"$tmp/bad"
    done
done
report "docs/X.md \"Heading\" references name a heading" "$tmp/bad"

# 3. no issue numbers or sessions in user-facing docs
: >"$tmp/bad"
for f in $docs moept.h; do
    joined "$f" | sed -E "s/'s (GitHub )?issue [0-9]+//g" |
        grep -nE '(^|[^&A-Za-z0-9/_])#[0-9]+|\b[Ii]ssue #?[0-9]+|[Ii]ssues #[0-9]+|\b[Ss]essions?\b' |
        cut -c1-160 | sed "s|^|$f: paragraph |" >>"$tmp/bad"
done
report "no issue numbers or sessions in README.md, moept.h, docs/*.md" "$tmp/bad"

# 4. the claims found false stay gone, the true ones stay said
: >"$tmp/bad"
false_jitter='.{0,40}(Not read: router_jitter_noise|router_jitter_noise[^.]{0,40}not read).{0,20}'
joined moept.h | grep -oE "$false_jitter" |
    sed 's/^/moept.h: says router_jitter_noise is not read: /' >>"$tmp/bad"
grep -q '"router_jitter_noise"' moept.c &&
    ! joined moept.h | grep -q 'router_jitter_noise (mixtral) is read' &&
    echo "moept.h: does not say moept_config_from_hf reads router_jitter_noise" >>"$tmp/bad"
freq="moe_layer_freq is applied as DeepSeek's own.*transformers' DeepseekV3 ignores the key"
joined moept.h | grep -q "$freq" ||
    echo "moept.h: does not say how moe_layer_freq is applied and that transformers ignores it" >>"$tmp/bad"
joined README.md | grep -oE 'every reference case passes at[^.]*' |
    sed 's/^/README.md: no word of the skipped cases: /' >>"$tmp/bad"
report "false claims absent (router_jitter_noise, moe_layer_freq, --ep cases)" "$tmp/bad"

# 5. one link line; mpirun lines that start on 2 cores
: >"$tmp/bad"
line='cc your.o moept.o -lm -pthread'
for f in README.md moept.h; do
    grep -qF "$line" "$f" || echo "$f: no link line \"$line\"" >>"$tmp/bad"
    joined "$f" | grep -oiE '[^.]*link with -l[^.]*' | sed "s|^|$f: another link line: |" >>"$tmp/bad"
done
grep -nE 'mpirun .*build/train_mpi' README.md | grep -v -- '--oversubscribe' |
    sed 's/^/README.md:/; s/$/ (no --oversubscribe)/' >>"$tmp/bad"
report "one link line in README.md and moept.h; mpirun lines carry --oversubscribe" "$tmp/bad"

# 6. dated figures in docs/PERF.md, test-run times in docs/TESTING.md
: >"$tmp/bad"
awk '{ print } /\*\// { exit }' moept.h >"$tmp/moept_top"
date_re='(^|[^0-9])20[0-9][0-9]-[01][0-9]-[0-3][0-9]([^0-9]|$)'
run_re='`make (test|check)`[^.]* (took|takes|ran in)|CI.s (whole |clean-clone )?run[^.]* took'
run_re="$run_re|[0-9]+ passed, [0-9]+ failed"
quote_ok() { # a README paragraph quoting make run's or make test's time, linked to where it lives
    printf '%s\n' "$1" | grep -qE '`make (run|test)`' &&
        printf '%s\n' "$1" | grep -qE '\(docs/(PERF|TESTING)\.md[#)]'
}
for f in $docs "$tmp/moept_top"; do
    case $f in docs/PERF.md|docs/TESTING.md) continue ;; esac
    name=$f; [ "$f" = "$tmp/moept_top" ] && name="moept.h (top comment)"
    joined "$f" | while IFS= read -r para; do
        dated=$(printf '%s\n' "$para" | grep -cE "$date_re")
        timed=$(printf '%s\n' "$para" | sed 's/\. /.\n/g' | grep -cE "$run_re")
        [ "$dated" = 0 ] && [ "$timed" = 0 ] && continue
        [ "$f" = README.md ] && quote_ok "$para" && continue
        printf '%s: %s\n' "$name" "$(printf '%s' "$para" | cut -c1-150)" >>"$tmp/bad"
    done
done
joined docs/PERF.md | sed 's/\. /.\n/g' | grep -E "$run_re" | cut -c1-150 |
    sed 's|^|docs/PERF.md: a test-run time (docs/TESTING.md holds them): |' >>"$tmp/bad"
report "dated figures only in docs/PERF.md, test-run times only in docs/TESTING.md" "$tmp/bad"

# 7. measured figures only in docs/PERF.md and docs/TESTING.md (the rule: the top comment)
: >"$tmp/bad"
# sections whose figures are not this project's measurements, FILE|HEADING, each under its reason
grep -v '^#' >"$tmp/figures_ok" <<'EOF'
# the planner's predictions (they depend on no machine) beside a published run's own figures;
# docs/PERF.md, "The planner's check (`build/plan --check`)", has the command's output
docs/PLAN.md|The check against the published fine-tune
EOF
while IFS='|' read -r f head; do
    grep -qE "^#+ $(printf '%s' "$head" | sed 's/[][\.*^$()+?{}|]/\\&/g')\$" "$f" 2>/dev/null ||
        echo "tests/check_docs.sh: its figures' section \"$head\" is no heading of $f" >>"$tmp/bad"
done <"$tmp/figures_ok"
# a file's prose, a paragraph a line as "HEADING<TAB>TEXT" (a list item, a table row and a heading
# each one); code blocks, `inline code` and comments left out; md=0: a C comment (no indented code)
prose() {
    awk -v md="${2:-1}" '
        function flush() { if (p != "") print head "\t" p; p = "" }
        /^ *```/ { flush(); fence = !fence; next }
        fence { next }
        NF == 0 { flush(); blank = 1; next }
        md && (blank || icode) && /^    / { icode = 1; next }
        { icode = 0; blank = 0 }
        md && /^#+ / { flush(); head = $0; sub(/^#+ +/, "", head); print head "\t" head; next }
        /^ *\|/ || /^ *([-*]|[0-9]+\.) / { flush() }
        {
            s = $0; sub(/^[ \t*\/]+/, "", s)
            gsub(/<!--[^>]*-->/, "", s); gsub(/`[^`]*`/, "", s)
            p = p " " s
            if ($0 ~ /^ *\|/) flush()
        }
        END { flush() }' "$1"
}
measured() { # file name, allowed headings (one a line): the measured figures' sentences
    awk -F '\t' -v name="$1" -v ok="$2" '
    BEGIN {
        n = split(ok, o, "\n"); for (i = 1; i <= n; i++) allowed[o[i]] = 1
        num = "[0-9]+([.,][0-9]+)*"
        unit = "(ns|µs|us|ms|s|secs?|seconds?|min|mins|minutes?|hours?|[kmgtp]i?b|([kmgt] )?[a-z]+/s)"
        fig = "(^|[^a-z0-9_.])" num " ?" unit "([^a-z0-9_/]|$)"
        ratio = "[0-9](x|×)([^a-z0-9]|$)"
        said = "(^|[^a-z])(measur(ed|ing|ements?)|faster|slower|speed-?ups?|median|best of|fastest|slowest"
        said = said "|wall[- ]clock|of cpu|cpu time|resident|rss|high-water)([^a-z]|$)|[0-9] ?(tokens|tok)/s"
        ran = "(^|[^a-z])(took|takes?|taking|ran|runs?|running|came to|comes to|reach(es|ed)?|achiev(es|ed)?)"
        ran = ran " (about |~|only |under |over |up to |at |in |at most |at least )?[0-9]"
        on = "(^|[^a-z])on ((an?|the|one|this|that)( [^ ]+)?( [^ ]+)? "
        on = on "(h100|h200|a100|b200|gpu|epyc|xeon|machine)|[0-9]+ (cores|vcpus|threads|gpus))([^a-z]|$)"
    }
    $1 in allowed { next }
    $2 ~ /\]\(([^)]*\/)?(PERF|TESTING)\.md[#)]/ { next }
    {
        n = split($2, sent, /(\. |; )/)
        for (i = 1; i <= n; i++) {
            sub(/^ +/, "", sent[i]); s = tolower(sent[i])
            if (!(s ~ said || s ~ ran || s ~ on) || !(match(s, fig) || match(s, ratio))) continue
            from = RSTART > 70 ? RSTART - 70 : 1     # the figure, with what comes before it
            print name ($1 != "" ? " (" $1 ")" : "") ": " (from > 1 ? "..." : "") substr(sent[i], from, 150)
        }
    }'
}
mds=$( (echo "$docs"; git ls-files '*.md' 2>/dev/null) | tr ' ' '\n' | sort -u)
for f in $mds "$tmp/moept_top"; do
    case $f in docs/PERF.md|docs/TESTING.md|CHANGELOG.md) continue ;; esac
    ok=$(awk -F '|' -v f="$f" '$1 == f { print $2 }' "$tmp/figures_ok")
    if [ "$f" = "$tmp/moept_top" ]; then prose "$f" 0 | measured "moept.h (top comment)" ""
    else prose "$f" | measured "$f" "$ok"; fi >>"$tmp/bad"
done
report "measured figures only in docs/PERF.md and docs/TESTING.md (or linked to them)" "$tmp/bad"
exit $status
