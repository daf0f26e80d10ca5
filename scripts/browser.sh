#!/usr/bin/env bash
# Headless Chromium and its WebDriver from Debian's packages, for the Django admin's browser test
# (tests/django/test_admin_browser.py): installed when missing. Runs as root (CI, the dev box).
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q chromium chromium-driver || {
    apt-get update -q && apt-get install -y -q chromium chromium-driver
}
