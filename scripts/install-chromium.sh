#!/usr/bin/env bash
# Headless Debian chromium for the `browser` tests (the HTML report is screenshotted).
# Idempotent: does nothing when /usr/bin/chromium is already there.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# Another script (make slurm-up) may hold the apt lock: wait for it rather than fail.
APT=(apt-get -o DPkg::Lock::Timeout=600)
$SUDO "${APT[@]}" update -qq
# fonts-dejavu-core: text in the screenshot needs at least one font.
$SUDO "${APT[@]}" install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
/usr/bin/chromium --version
