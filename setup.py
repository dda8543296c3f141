"""Maps the repo's top-level folders onto the `specdec` namespace.

heads/ -> specdec.heads, train/ -> specdec.train, infer/ -> specdec.infer,
recipes/ -> specdec.recipes (YAML recipes as package data). Sub-packages are
found automatically, so adding a folder with an __init__.py needs no edit here.
"""
from setuptools import find_packages, setup

ROOTS = {"heads": "specdec.heads", "train": "specdec.train", "infer": "specdec.infer", "recipes": "specdec.recipes"}

packages, package_dir = [], {}
for folder, name in ROOTS.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
