"""Headless Chromium driven through chromedriver (selenium), for tests that look at the Prefect UI.

Debian's `chromium` and `chromium-driver` (`make browser-tools` installs them where root and apt
can). Tests skip only where they are missing and cannot be installed: without root or apt-get.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1100")
# every image of the page that is a data: URI: [alt, complete, natural width, natural height]
DATA_IMAGES = """return Array.from(document.images).filter(i => i.src.startsWith('data:image/'))
                 .map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight])"""


def browser_paths() -> tuple[str, str]:
    """(chromium, chromedriver); skips the test where they are missing and cannot be installed,
    fails it where `make browser-tools` would install them (so CI never skips it quietly)."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    missing = " and ".join(name for name, path in (("chromium", chromium), ("chromedriver", driver)) if not path)
    if os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail(f"{missing} not found, and this machine can install them: run `make browser-tools`")
    pytest.skip(f"{missing} not found and not installable here (needs root and apt-get): install the Debian "
                "packages chromium and chromium-driver")


@contextmanager
def chromium():
    """A headless Chromium (selenium WebDriver) with a fresh profile, quit at the end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = browser_paths()
    with tempfile.TemporaryDirectory(prefix="posttrain-chromium-") as profile:
        options = Options()
        for flag in (*FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        options.binary_location = binary
        driver = webdriver.Chrome(service=Service(driver_path), options=options)  # a given driver: no download
        try:
            yield driver
        finally:
            driver.quit()


def loaded_data_images(driver, url: str, timeout: float = 60) -> list[list]:
    """Open `url` and wait until one of its data: images has loaded (complete, natural width > 0);
    returns them all. Fails with what the page shows when none does within `timeout`."""
    driver.get(url)
    deadline = time.monotonic() + timeout
    while True:
        images = driver.execute_script(DATA_IMAGES)
        if any(complete and width > 0 for _, complete, width, _ in images):
            return images
        if time.monotonic() > deadline:
            text = driver.execute_script("return document.body.innerText")[:1500]
            raise AssertionError(f"no data: image loaded at {url} in {timeout:g}s; images {images}; page: {text}")
        time.sleep(0.5)


def screenshot(driver, path) -> None:
    """The page with its first data: image scrolled into view, as a PNG at `path`."""
    driver.execute_script("const i = Array.from(document.images).find(i => i.src.startsWith('data:image/'));"
                          "if (i) i.scrollIntoView({block: 'center'});")
    time.sleep(0.3)
    driver.save_screenshot(str(path))
