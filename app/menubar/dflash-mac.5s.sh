#!/bin/sh
# <xbar.title>dflash-mac</xbar.title>
# <xbar.version>v0.1.0</xbar.version>
# <xbar.author>dflash-mac</xbar.author>
# <xbar.desc>Start and stop the local dflash-mac OpenAI-compatible server; shows tok/s and tau.</xbar.desc>
# <xbar.dependencies>dflash-mac,curl</xbar.dependencies>
# <xbar.var>string(DFLASH_MAC_PORT="8080"): Port of dflash-mac serve.</xbar.var>
# <xbar.var>string(DFLASH_MAC_MODEL=""): Target model (empty: the bundled pair).</xbar.var>
# <xbar.var>string(DFLASH_MAC_DRAFT=""): DFlash drafter (empty: the bundled pair).</xbar.var>
# <swiftbar.hideAbout>true</swiftbar.hideAbout>
# <swiftbar.hideRunInTerminal>true</swiftbar.hideRunInTerminal>
#
# SwiftBar / xbar plugin for dflash-mac (plain POSIX sh + curl), refreshed every 5 s.
# Install: symlink this file into the SwiftBar plugin folder (see docs/editors.md).
# Settings (environment): DFLASH_MAC_CMD (default: dflash-mac), DFLASH_MAC_HOST, DFLASH_MAC_PORT,
# DFLASH_MAC_MODEL, DFLASH_MAC_DRAFT, DFLASH_MAC_SERVE_ARGS (extra serve flags),
# DFLASH_MAC_HOME (data dir holding serve-PORT.pid, serve-PORT.url and serve-PORT.log).
# Actions: "$0 start|stop [PORT]|chat|copy-url|open-log" (what the menu items run).
# Each running server (one per port) is listed; start/stop act on DFLASH_MAC_PORT by default.

PATH="$PATH:/opt/homebrew/bin:/usr/local/bin:$HOME/.local/bin"
CMD=${DFLASH_MAC_CMD:-dflash-mac}
HOST=${DFLASH_MAC_HOST:-127.0.0.1}
PORT=${DFLASH_MAC_PORT:-8080}
if [ -n "$DFLASH_MAC_HOME" ]; then
    DATA=$DFLASH_MAC_HOME
elif [ "$(uname)" = Darwin ]; then
    DATA="$HOME/Library/Application Support/dflash-mac"
else
    DATA="${XDG_DATA_HOME:-$HOME/.local/share}/dflash-mac"
fi
PIDFILE="$DATA/serve-$PORT.pid"
LOG="$DATA/serve-$PORT.log"

# The base URL of the server on port $1 (from its URL file when it wrote one).
url_of() {
    if [ -s "$DATA/serve-$1.url" ]; then head -n 1 "$DATA/serve-$1.url"; else echo "http://$HOST:$1/v1"; fi
}
URL=$(url_of "$PORT")
ROOT=${URL%/v1}
case $0 in /*) SELF=$0 ;; *) SELF="$(pwd)/$0" ;; esac

# Whether PID is a live (not zombie) process.
alive() {
    kill -0 "$1" 2>/dev/null || return 1
    case $(ps -p "$1" -o stat= 2>/dev/null) in *Z*) return 1 ;; esac
}

# The PID of a live `serve` process from the PID file of port $1 (default $PORT), or failure.
server_pid() {
    file="$DATA/serve-${1:-$PORT}.pid"
    [ -s "$file" ] || return 1
    pid=$(head -n 1 "$file" | tr -cd 0-9)
    [ -n "$pid" ] && alive "$pid" || return 1
    case $(ps -p "$pid" -o command= 2>/dev/null) in *serve*) ;; *) return 1 ;; esac
    echo "$pid"
}

# The /health body of a server that answers, or failure.
health() { curl -fsS --max-time 2 "$ROOT/health" 2>/dev/null; }

# A string field of the /health JSON (no nested quotes expected).
health_field() { printf '%s\n' "$HEALTH" | sed -n "s/.*\"$1\": *\"\([^\"]*\)\".*/\1/p" | head -n 1; }

metric() { printf '%s\n' "$METRICS" | awk -v k="$1" '$1 == k { print $2; exit }'; }

info_label() {
    printf '%s\n' "$METRICS" | sed -n "s/^dflash_info{.*$1=\"\([^\"]*\)\".*/\1/p" | head -n 1
}

do_start() {
    if server_pid >/dev/null; then echo "dflash-mac serve is already running"; return 0; fi
    mkdir -p "$DATA"
    set -- serve --host "$HOST" --port "$PORT"
    [ -n "$DFLASH_MAC_MODEL" ] && set -- "$@" --model "$DFLASH_MAC_MODEL"
    [ -n "$DFLASH_MAC_DRAFT" ] && set -- "$@" --draft "$DFLASH_MAC_DRAFT"
    DFLASH_MAC_HOME=$DATA
    export DFLASH_MAC_HOME
    # $CMD and $DFLASH_MAC_SERVE_ARGS are split into words on purpose.
    # shellcheck disable=SC2086
    nohup $CMD "$@" $DFLASH_MAC_SERVE_ARGS >>"$LOG" 2>&1 </dev/null &
    # nohup and the server exec in place, so $! is the server's PID: "starting" from now on
    # (the server rewrites the file with the same PID once it runs, and removes it on exit).
    echo "$!" >"$PIDFILE"
    echo "started dflash-mac serve (PID $!)"
}

do_stop() {
    port=${1:-$PORT}
    case $port in *[!0-9]* | "") echo "not a port: $port" >&2; return 2 ;; esac
    pid=$(server_pid "$port") || { echo "dflash-mac serve is not running on port $port"; return 0; }
    kill -TERM "$pid" 2>/dev/null
    i=0
    while alive "$pid" && [ "$i" -lt 50 ]; do sleep 0.2; i=$((i + 1)); done
    if alive "$pid"; then
        kill -KILL "$pid" 2>/dev/null
        rm -f "$DATA/serve-$port.pid" "$DATA/serve-$port.url"
    fi
    echo "stopped dflash-mac serve on port $port (PID $pid)"
}

do_chat() {
    line="$CMD chat"
    [ -n "$DFLASH_MAC_MODEL" ] && line="$line --model '$DFLASH_MAC_MODEL'"
    [ -n "$DFLASH_MAC_DRAFT" ] && line="$line --draft '$DFLASH_MAC_DRAFT'"
    if command -v osascript >/dev/null 2>&1; then
        esc=$(printf '%s' "$line" | sed 's/\\/\\\\/g; s/"/\\"/g')
        osascript -e "tell application \"Terminal\" to do script \"$esc\"" \
            -e 'tell application "Terminal" to activate' >/dev/null
    elif command -v x-terminal-emulator >/dev/null 2>&1; then
        x-terminal-emulator -e sh -c "$line" >/dev/null 2>&1 &
    else
        echo "no terminal application found; run: $line" >&2
        return 1
    fi
}

do_copy() {
    for c in pbcopy wl-copy "xclip -selection clipboard"; do
        # shellcheck disable=SC2086
        if command -v ${c%% *} >/dev/null 2>&1; then printf '%s' "$URL" | $c; return; fi
    done
    echo "$URL"
}

do_open_log() {
    for c in open xdg-open; do
        if command -v "$c" >/dev/null 2>&1; then "$c" "$LOG"; return; fi
    done
    echo "$LOG"
}

case $1 in
    start) do_start; exit ;;
    stop) do_stop "$2"; exit ;;
    chat) do_chat; exit ;;
    copy-url) do_copy; exit ;;
    open-log) do_open_log; exit ;;
    "") ;;
    *) echo "usage: $0 [start|stop [PORT]|chat|copy-url|open-log]" >&2; exit 2 ;;
esac

# ---- menu ------------------------------------------------------------------------------------
# Ports of the other live servers (PID files of other ports in $DATA).
OTHERS=""
for f in "$DATA"/serve-*.pid; do
    [ -e "$f" ] || continue
    p=${f##*/serve-}
    p=${p%.pid}
    case $p in *[!0-9]* | "") continue ;; esac
    [ "$p" = "$PORT" ] && continue
    server_pid "$p" >/dev/null && OTHERS="$OTHERS $p"
done
NOTHERS=$(echo $OTHERS | wc -w | tr -d ' ')
MORE=""
[ "$NOTHERS" -gt 0 ] && MORE=" · +$NOTHERS"

PID=$(server_pid)
METRICS=""
if HEALTH=$(health); then
    METRICS=$(curl -fsS --max-time 2 "$ROOT/metrics?format=prometheus" 2>/dev/null)
    STATE=running
    # The last generation failed: the server answers but does not generate.
    [ "$(health_field status)" = degraded ] && STATE=degraded
elif [ -n "$PID" ]; then
    STATE=starting
else
    STATE=stopped
fi

TPS=$(metric dflash_last_decode_tps)
TAU=$(metric dflash_last_tau)
case $STATE in
    running)
        if [ -n "$TPS" ]; then
            printf '● dflash %.1f tok/s · τ %.2f%s\n' "$TPS" "$TAU" "$MORE"
        else
            echo "● dflash running$MORE"
        fi ;;
    degraded) echo "▲ dflash failing$MORE" ;;
    starting) echo "◐ dflash starting$MORE" ;;
    stopped)
        if [ "$NOTHERS" -gt 0 ]; then echo "● dflash $NOTHERS running"; else echo "○ dflash stopped"; fi ;;
esac
echo "---"
case $STATE in
    running) echo "Server: running at $URL${PID:+ (PID $PID)} | color=green" ;;
    degraded)
        echo "Server: failing at $URL${PID:+ (PID $PID)}: the last request failed | color=red"
        health_field last_error | cut -c 1-120 | sed 's/|/¦/g; s/^/--/; s/$/ | color=red font=Menlo size=11/' ;;
    starting) echo "Server: starting (loading the model, PID $PID)" ;;
    stopped) echo "Server: stopped" ;;
esac
if [ "$STATE" = running ] || [ "$STATE" = degraded ]; then
    echo "Model: $(info_label model) ($(info_label drafter))"
    echo "--Target: $(info_label model_id) | font=Menlo size=11"
    echo "--Draft: $(info_label draft) | font=Menlo size=11"
    if [ -n "$TPS" ]; then
        printf 'Last request: %.1f tok/s, τ %.2f, %s tokens (%s cached prompt)\n' "$TPS" "$TAU" \
            "$(metric dflash_last_completion_tokens)" "$(metric dflash_last_cached_tokens)"
    fi
    echo "Requests: $(metric dflash_requests_total), $(metric dflash_failed_total) failed, $(metric dflash_completion_tokens_total) tokens generated"
fi
echo "---"
if [ -n "$PID" ]; then
    echo "Stop server | bash=\"$SELF\" param1=stop terminal=false refresh=true"
elif [ "$STATE" = stopped ]; then
    echo "Start server | bash=\"$SELF\" param1=start terminal=false refresh=true"
else
    echo "Server started outside this launcher (no PID file in $DATA)"
fi
for p in $OTHERS; do
    purl=$(url_of "$p")
    METRICS=$(curl -fsS --max-time 2 "${purl%/v1}/metrics?format=prometheus" 2>/dev/null)
    echo "---"
    if [ -n "$METRICS" ]; then
        echo "Server on port $p: $(info_label model) at $purl (PID $(server_pid "$p")) | color=green"
        ptps=$(metric dflash_last_decode_tps)
        [ -n "$ptps" ] && printf -- '--Last request: %.1f tok/s, τ %.2f\n' "$ptps" "$(metric dflash_last_tau)"
        echo "--Requests: $(metric dflash_requests_total), $(metric dflash_failed_total) failed"
    else
        echo "Server on port $p: starting (PID $(server_pid "$p"))"
    fi
    echo "--Stop this server | bash=\"$SELF\" param1=stop param2=$p terminal=false refresh=true"
done
echo "---"
echo "Open chat in Terminal | bash=\"$SELF\" param1=chat terminal=false refresh=true"
echo "Copy base URL ($URL) | bash=\"$SELF\" param1=copy-url terminal=false refresh=true"
echo "---"
echo "Recent log"
if [ -s "$LOG" ]; then
    tail -n 8 "$LOG" | cut -c 1-120 | sed 's/|/¦/g; s/^/-- /; s/$/ | font=Menlo size=11/'
    echo "--Open log file | bash=\"$SELF\" param1=open-log terminal=false refresh=true"
else
    echo "--(no log yet)"
fi
echo "Refresh | refresh=true"
