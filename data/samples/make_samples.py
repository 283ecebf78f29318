"""Write the eight sample prompt datasets in data/samples/ (deterministic; run from anywhere).

Every prompt here was written for this project from hand-made topic lists and
templates; nothing is copied from a public dataset. The files are prompt-only: the
target model writes the answers, so rows carry no reference completions (multi-turn
rows keep the earlier assistant turns as context).

    python data/samples/make_samples.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_jsonl(name: str, rows: list[dict]) -> None:
    """One JSON object per line, UTF-8."""
    with open(HERE / name, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- chat_general (openai)

FACT_QUESTIONS = """\
What is the boiling point of water at sea level in Celsius?
Which planet is closest to the Sun?
How many sides does a hexagon have?
What gas do plants take in from the air during photosynthesis?
Who painted the ceiling of the Sistine Chapel?
What is the largest ocean on Earth?
What is the chemical symbol for gold?
How many minutes are there in a day?
What language do most people in Brazil speak?
What is the square root of 144?
Which organ pumps blood around the human body?
What is the freezing point of water in Fahrenheit?
What is the longest river in Africa?
How many continents are there?
What does CPU stand for?
Which element has atomic number 1?
What is the capital of Canada?
Who developed the theory of general relativity?
What is the hardest naturally occurring material?
How many bones does an adult human have?
What unit is electrical resistance measured in?
In which country is the city of Kyoto?
What is the main ingredient of guacamole?
In what year did people first walk on the Moon?
What is the smallest prime number?
What is the currency of Japan?
What do bees collect from flowers to make honey?
Which instrument usually has 88 keys?
What is the tallest mountain above sea level?
How many players does a soccer team have on the field?
What is the opposite of "ancient"?
Which vitamin does skin produce when exposed to sunlight?
What is the plural of "mouse"?
How many degrees are in a right angle?
What is the capital of Australia?
Which metal is liquid at room temperature?
What does HTML stand for?
What is the largest mammal alive today?
Which planet is famous for its bright rings?
How many hours are in a week?
What is the main language spoken in Quebec?
Who wrote "Pride and Prejudice"?
What is 15 percent of 200?
Which blood type is called the universal donor?
Roughly how fast does light travel in a vacuum, in kilometers per second?
What is a group of crows called?
On which continent is the Sahara Desert?
What is the number 10 written in binary?
How many strings does a standard violin have?
What is the capital of Kenya?
What does DNA stand for?
Which is heavier: a kilogram of feathers or a kilogram of iron?
What is the largest planet in the solar system?
Which season comes after autumn?
Which gas makes up most of Earth's atmosphere?
How many zeros are in one million?
What do you call a shape with three sides?
What is the past tense of "run"?
Which organ produces insulin?
How many teaspoons are in a tablespoon?
What is the nearest star to Earth?
What is the capital of Egypt?
Which animal is nicknamed the ship of the desert?
What is 3/4 written as a decimal?
What does RAM stand for in computing?
Who formulated the three laws of motion?
What is the largest desert in the world by area?
How many weeks are in a year?
What is the SI unit of force?
Which ocean lies between Africa and Australia?
What is a baby kangaroo called?
What color do you get by mixing blue and yellow?"""

FACT_FOLLOW_UPS = [
    (
        "What is the capital of France?",
        "The capital of France is Paris.",
        "Roughly how many people live there?",
    ),
    (
        "Name a prime number between 20 and 30.",
        "23 is a prime number between 20 and 30.",
        "Is there another one in that range?",
    ),
    (
        "Which planet is called the Red Planet?",
        "Mars is known as the Red Planet.",
        "Why does it look red?",
    ),
    ("What is the chemical formula of water?", "Water is H2O.", "And the formula of table salt?"),
    (
        "Who composed the Moonlight Sonata?",
        "Ludwig van Beethoven composed it.",
        "In which country was he born?",
    ),
    (
        "How many legs does a spider have?",
        "A spider has eight legs.",
        "And how many does an insect have?",
    ),
    (
        "What is the largest country by area?",
        "Russia is the largest country by area.",
        "Which country is second?",
    ),
    (
        "What does a thermometer measure?",
        "A thermometer measures temperature.",
        "What does a barometer measure?",
    ),
]

FACT_SYSTEMS = [
    "You are a concise assistant. Answer in one short sentence.",
    "Answer with the fact only, no explanation.",
    "You are a friendly quiz host. Give the answer and one fun detail about it.",
]


def chat_general() -> list[dict]:
    """Short factual questions; some with a system prompt, some with one earlier exchange."""
    rows = []
    for i, question in enumerate(FACT_QUESTIONS.splitlines()):
        messages = [{"role": "user", "content": question}]
        if i % 4 == 1:
            messages.insert(0, {"role": "system", "content": FACT_SYSTEMS[i // 4 % 3]})
        rows.append({"id": f"cg-{i:03d}", "messages": messages})
    for i, (q, a, follow) in enumerate(FACT_FOLLOW_UPS):
        messages = [
            {"role": "user", "content": q},
            {"role": "assistant", "content": a},
            {"role": "user", "content": follow},
        ]
        rows.append({"id": f"cg-mt-{i:02d}", "messages": messages})
    return rows


# ---------------------------------------------------------------- code_instruct (opencodeinstruct)

FUNCTIONS = [
    (
        "function `is_palindrome(s: str) -> bool`",
        "Return True when the string reads the same backwards, ignoring case, spaces and punctuation.",
    ),
    (
        "function `flatten(nested: list) -> list`",
        "Flatten arbitrarily nested lists into one flat list, keeping the order of elements.",
    ),
    (
        "function `word_frequencies(text: str) -> dict[str, int]`",
        "Count how often each word appears, case-insensitively and ignoring punctuation.",
    ),
    (
        "function `merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]`",
        "Merge all overlapping intervals and return them sorted by start.",
    ),
    (
        "function `fibonacci(n: int) -> int`",
        "Return the n-th Fibonacci number using an iterative loop; raise ValueError for negative n.",
    ),
    (
        "function `chunk(items: list, size: int) -> list[list]`",
        "Split a list into consecutive chunks of the given size; the last chunk may be shorter.",
    ),
    (
        "function `roman_to_int(s: str) -> int`",
        "Convert a Roman numeral such as 'MCMXCIV' to an integer.",
    ),
    (
        "function `int_to_roman(n: int) -> str`",
        "Convert an integer between 1 and 3999 to a Roman numeral and reject values outside that range.",
    ),
    (
        "function `rotate_matrix(m: list[list[int]]) -> list[list[int]]`",
        "Rotate a square matrix 90 degrees clockwise without modifying the input.",
    ),
    (
        "function `binary_search(items: list[int], target: int) -> int`",
        "Return the index of target in a sorted list, or -1 when it is absent.",
    ),
    (
        "function `two_sum(nums: list[int], target: int) -> tuple[int, int] | None`",
        "Find two different indices whose values add up to target in linear time.",
    ),
    (
        "function `anagram_groups(words: list[str]) -> list[list[str]]`",
        "Group words that are anagrams of each other.",
    ),
    (
        "function `parse_duration(text: str) -> int`",
        "Turn strings like '1h30m15s' or '45m' into a number of seconds, raising ValueError on bad input.",
    ),
    (
        "function `longest_common_prefix(words: list[str]) -> str`",
        "Return the longest prefix shared by every word in the list.",
    ),
    (
        "function `dedupe(items: list) -> list`",
        "Remove duplicates while preserving the order in which items first appear.",
    ),
    (
        "function `run_length_encode(s: str) -> str`",
        "Compress a string so that 'aaabcc' becomes 'a3b1c2'.",
    ),
    (
        "function `run_length_decode(s: str) -> str`",
        "Reverse run-length encoding so that 'a3b1c2' becomes 'aaabcc', including counts above 9.",
    ),
    (
        "function `lcm(a: int, b: int) -> int`",
        "Compute the least common multiple of two positive integers using the greatest common divisor.",
    ),
    (
        "function `is_prime(n: int) -> bool`",
        "Test whether n is prime, fast enough for numbers up to 10**12.",
    ),
    (
        "function `primes_up_to(n: int) -> list[int]`",
        "Return all primes up to n with the Sieve of Eratosthenes.",
    ),
    (
        "function `moving_average(values: list[float], window: int) -> list[float]`",
        "Compute the simple moving average for every full window.",
    ),
    (
        "function `balanced(s: str) -> bool`",
        "Check that (), [] and {} brackets in a string are balanced and properly nested.",
    ),
    (
        "function `camel_to_snake(name: str) -> str`",
        "Convert names like 'parseHTTPResponse' to 'parse_http_response'.",
    ),
    (
        "function `second_largest(nums: list[int]) -> int | None`",
        "Return the second largest distinct value, or None when there is none.",
    ),
    (
        "function `matmul(a: list[list[float]], b: list[list[float]]) -> list[list[float]]`",
        "Multiply two matrices given as nested lists and raise ValueError for incompatible shapes.",
    ),
    (
        "function `caesar(text: str, shift: int) -> str`",
        "Apply a Caesar cipher, preserving case and leaving non-letters unchanged.",
    ),
    (
        "function `levenshtein(a: str, b: str) -> int`",
        "Compute the edit distance between two strings using O(min(len(a), len(b))) memory.",
    ),
    (
        "function `top_k_frequent(nums: list[int], k: int) -> list[int]`",
        "Return the k most frequent values, most frequent first, breaking ties by smaller value.",
    ),
    (
        "function `group_by(records: list[dict], key: str) -> dict`",
        "Group dictionaries by the value of a key, skipping records that lack it.",
    ),
    (
        "function `format_bytes(n: int) -> str`",
        "Format a byte count in human-readable binary units, e.g. 1536 -> '1.5 KiB'.",
    ),
    (
        "function `parse_csv_line(line: str) -> list[str]`",
        "Split one CSV line into fields, handling quoted fields that contain commas and doubled quotes.",
    ),
    (
        "function `median(values: list[float]) -> float`",
        "Return the median of a non-empty list without sorting the input in place.",
    ),
    ("function `is_leap_year(year: int) -> bool`", "Apply the Gregorian leap year rules."),
    (
        "function `days_between(start: str, end: str) -> int`",
        "Return the number of days between two ISO dates such as '2024-02-27' and '2024-03-02'.",
    ),
    (
        "function `reverse_words(sentence: str) -> str`",
        "Reverse the order of the words but keep each word intact and collapse repeated spaces.",
    ),
    (
        "function `max_subarray(nums: list[int]) -> int`",
        "Return the largest sum of a contiguous subarray using Kadane's algorithm.",
    ),
    (
        "function `pascal(n: int) -> list[list[int]]`",
        "Build the first n rows of Pascal's triangle.",
    ),
    (
        "function `digital_root(n: int) -> int`",
        "Sum the digits of n repeatedly until a single digit remains.",
    ),
    (
        "function `is_valid_sudoku(board: list[list[str]]) -> bool`",
        "Check a partially filled 9x9 Sudoku board, where '.' marks an empty cell, for rule violations.",
    ),
    (
        "function `count_islands(grid: list[list[int]]) -> int`",
        "Count groups of horizontally or vertically connected 1s in a grid of 0s and 1s.",
    ),
    (
        "function `deep_merge(a: dict, b: dict) -> dict`",
        "Merge b into a copy of a recursively, so nested dictionaries are merged rather than replaced.",
    ),
    (
        "decorator `retry(times: int, exceptions: tuple)`",
        "Re-run the wrapped function up to `times` times when it raises one of the given exceptions, then re-raise.",
    ),
    (
        "decorator `memoize(maxsize: int)`",
        "Cache results of a function with hashable arguments, evicting the least recently used entry when full.",
    ),
    (
        "context manager `timer(label: str)`",
        "Print how long the enclosed block took, in milliseconds, even when it raises.",
    ),
    (
        "function `slugify(title: str) -> str`",
        "Turn a title into a URL slug: lowercase, ASCII only, words joined by hyphens.",
    ),
    (
        "function `truncate(text: str, limit: int, suffix: str = '...') -> str`",
        "Shorten text to at most `limit` characters, cutting at a word boundary and appending the suffix.",
    ),
    (
        "function `mask_card(number: str) -> str`",
        "Replace every digit of a card number except the last four with '*', keeping spaces.",
    ),
    (
        "function `luhn_valid(number: str) -> bool`",
        "Validate a credit card number with the Luhn checksum.",
    ),
    (
        "function `to_base(n: int, base: int) -> str`",
        "Write a non-negative integer in any base from 2 to 36.",
    ),
    (
        "function `parse_query(qs: str) -> dict[str, list[str]]`",
        "Parse a URL query string into a dict of lists, decoding percent-escapes, without urllib.",
    ),
    (
        "function `wrap(text: str, width: int) -> list[str]`",
        "Wrap text into lines no longer than width, breaking only at spaces unless a word is too long.",
    ),
    (
        "function `histogram(values: list[float], bins: int) -> list[int]`",
        "Count values into equal-width bins spanning the minimum to the maximum.",
    ),
    (
        "function `percentile(values: list[float], p: float) -> float`",
        "Return the p-th percentile using linear interpolation between closest ranks.",
    ),
    (
        "function `interleave(*lists: list) -> list`",
        "Interleave several lists element by element, continuing with the longer ones when others run out.",
    ),
    (
        "function `compress_ranges(nums: list[int]) -> str`",
        "Describe sorted integers compactly, so [1, 2, 3, 5, 7, 8] becomes '1-3,5,7-8'.",
    ),
    (
        "function `expand_ranges(spec: str) -> list[int]`",
        "Expand strings like '1-3,5,7-8' into the list of integers they describe.",
    ),
    (
        "function `spiral(matrix: list[list[int]]) -> list[int]`",
        "Return the elements of a matrix in clockwise spiral order.",
    ),
    (
        "function `closest_points(points: list[tuple[float, float]], k: int) -> list[tuple[float, float]]`",
        "Return the k points closest to the origin using a heap.",
    ),
    (
        "function `is_isogram(word: str) -> bool`",
        "Tell whether a word has no repeating letters, ignoring hyphens and spaces.",
    ),
    (
        "function `read_jsonl(path: str) -> list[dict]`",
        "Read a JSON Lines file, skipping blank lines and reporting the line number of any invalid line.",
    ),
    (
        "function `count_code_lines(path: str) -> int`",
        "Count the lines of a Python file that are neither blank nor comments.",
    ),
    (
        "function `password_problems(password: str) -> list[str]`",
        "Return a list of the rules a password breaks: length under 12, no digit, no uppercase letter, no symbol.",
    ),
    (
        "class `Stack`",
        "Implement push, pop, peek, is_empty and __len__, raising IndexError when popping an empty stack.",
    ),
    (
        "class `TwoStackQueue`",
        "Implement a FIFO queue on top of two lists used as stacks, with amortized O(1) enqueue and dequeue.",
    ),
    (
        "function `time_in_words(hhmm: str) -> str`",
        "Say a time in English words, so '7:15' becomes 'quarter past seven' and '8:40' becomes 'twenty to nine'.",
    ),
    (
        "function `knapsack(weights: list[int], values: list[int], capacity: int) -> int`",
        "Solve the 0/1 knapsack problem with dynamic programming.",
    ),
    (
        "function `topo_sort(graph: dict[str, list[str]]) -> list[str]`",
        "Return a topological order of a dependency graph and raise ValueError naming a node on a cycle.",
    ),
    (
        "function `rle_image(rows: list[str]) -> list[list[tuple[str, int]]]`",
        "Run-length encode each row of a small ASCII image.",
    ),
    (
        "function `validate_ipv4(address: str) -> bool`",
        "Check that a string is a dotted-quad IPv4 address with no leading zeros.",
    ),
    (
        "function `sum_of_multiples(limit: int, factors: list[int]) -> int`",
        "Sum every number below limit that is a multiple of at least one factor.",
    ),
    (
        "class `BankAccount`",
        "Support deposit, withdraw and a balance property; reject negative amounts and overdrafts with ValueError.",
    ),
    (
        "function `next_business_day(day: str, holidays: set[str]) -> str`",
        "Return the next ISO date after `day` that is not a weekend or a holiday.",
    ),
    (
        "function `longest_increasing_subsequence(nums: list[int]) -> list[int]`",
        "Return one longest strictly increasing subsequence in O(n log n).",
    ),
    (
        "function `word_ladder_length(start: str, end: str, words: list[str]) -> int`",
        "Return the length of the shortest transformation sequence changing one letter at a time, or 0.",
    ),
    (
        "function `matrix_determinant(m: list[list[float]]) -> float`",
        "Compute the determinant of a square matrix with Gaussian elimination and partial pivoting.",
    ),
]

CODE_TEMPLATES = [
    "Write a Python {what}. {desc}",
    "Implement the {what} in Python. {desc} Include a docstring and type hints.",
    "Create a Python {what}. {desc} Add two doctest examples.",
    "I need a small, dependency-free Python {what}. {desc}",
    "Write the {what} in Python. {desc} After the code, show one example call and its output.",
]


def code_instruct() -> list[dict]:
    """One Python function or class per prompt, phrased five ways in turn."""
    rows = []
    for i, (what, desc) in enumerate(FUNCTIONS):
        text = CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(what=what, desc=desc)
        rows.append({"id": f"oci-{i:04d}", "input": text, "domain": "generic"})
    return rows


# ---------------------------------------------------------------- code_problems (magicoder)

PROGRAMS = [
    "reads a CSV file given on the command line and prints the average of its `price` column",
    "counts the words in a text file and prints the ten most common ones",
    "asks for a temperature in Celsius and prints it in Fahrenheit and Kelvin",
    "keeps a shopping list in memory with add, remove and show commands read from input",
    "simulates rolling two dice 1,000 times and prints how often each total came up",
    "checks whether the brackets in a string are balanced and prints the position of the first error",
    "renames every `.txt` file in a folder by adding today's date to its name",
    "prints a multiplication table from 1 to 10, aligned in columns",
    "plays a number-guessing game: pick a random number from 1 to 100 and answer higher or lower",
    "converts a Roman numeral given as input to an integer and back",
    "prints the prime numbers below a limit read from the command line, using a sieve",
    "merges two sorted lists of numbers read from input into one sorted list",
    "reads a JSON file of people with names and ages and prints them sorted by age",
    "prints the size of every file in a folder, largest first, in KB",
    "generates a random password of a length given on the command line, with letters, digits and symbols",
    "computes simple interest and compound interest for an amount, a rate and a number of years",
    "counts the vowels and consonants in a sentence read from input",
    "prints the Fibonacci numbers below 1,000, ten per line",
    "finds the longest line in a text file and prints its number and length",
    "converts a number of seconds read from input to hours, minutes and seconds",
    "checks whether a word read from input is a palindrome, ignoring case",
    "keeps a running total of expenses typed one per line until an empty line, then prints the total and the largest",
    "prints a text-based bar chart of the counts in a small dictionary",
    "removes duplicate lines from a text file, keeping the first occurrence of each",
]

PROGRAM_CLOSERS = [
    "Keep it under 30 lines and explain it in two sentences.",
    "Add a comment on each key step.",
    "Show an example run after the code.",
]


def code_problems() -> list[dict]:
    """Short whole programs (input, a loop, output), each task with the three closers. Longer
    than code_instruct's single functions, short enough for SmolLM2-135M to finish: projects
    with three requirements in seven languages sent it into loops until max_tokens, and so
    did JavaScript (issue 27)."""
    rows = []
    for what in PROGRAMS:
        for closer in PROGRAM_CLOSERS:
            problem = f"Write a short Python program that {what}. {closer}"
            rows.append({"index": len(rows), "lang": "python", "problem": problem})
    return rows


# ---------------------------------------------------------------- math_word (alpaca, JSON)

NAMES = [
    "Amara",
    "Ben",
    "Chen",
    "Dalia",
    "Emil",
    "Farah",
    "Goran",
    "Hana",
    "Ivo",
    "Jia",
    "Kofi",
    "Lena",
]

MATH_INSTRUCTIONS = [
    "Solve the following word problem. Show your reasoning step by step and put the final answer on its own line.",
    "Work out the answer to this math problem, explaining each step.",
    "Read the problem below and solve it. Give the final answer with its units.",
    "Solve this problem, then check your answer.",
]


def _math_problem(kind: int, r: random.Random) -> str:
    """One word problem of the given kind with random numbers."""
    n, m = r.sample(NAMES, 2)
    if kind == 0:
        a, b, p, q = r.randint(2, 9), r.randint(2, 9), r.randint(2, 6), r.randint(1, 3)
        return f"{n} buys {a} notebooks at ${p} each and {b} pens at ${q} each. How much does {n} spend in total?"
    if kind == 1:
        h = r.randint(2, 5)
        return f"A train travels {h * r.randint(60, 120)} km in {h} hours. At the same speed, how far does it travel in {h + r.randint(1, 4)} hours?"
    if kind == 2:
        w, k = r.randint(3, 15), r.randint(2, 9)
        return f"A rectangle has a perimeter of {2 * (2 * w + k)} cm, and its length is {k} cm more than its width. What is its area?"
    if kind == 3:
        s, inc, mo = r.randint(20, 80), r.randint(5, 15), r.randint(4, 12)
        return f"{n} saves ${s} in the first month and ${inc} more each month than the month before. How much has {n} saved in total after {mo} months?"
    if kind == 4:
        f, c = r.randint(2, 4), r.choice([12, 18, 24, 30])
        return f"A recipe uses {f} cups of flour to make {c} cookies. How many cups of flour are needed for {c * r.randint(2, 5) // 2} cookies?"
    if kind == 5:
        p, d, t = r.choice([40, 60, 80, 120, 150]), r.choice([10, 20, 25, 30]), r.choice([5, 8, 10])
        return f"A jacket costs ${p}. It is discounted by {d}%, and then a sales tax of {t}% is added to the discounted price. What is the final price?"
    if kind == 6:
        a, b = r.sample([2, 3, 4, 5, 6, 8], 2)
        return f"One pipe fills a water tank in {a} hours and a second pipe fills it in {b} hours. How long does it take to fill the tank with both pipes open?"
    if kind == 7:
        c, p = r.choice([20, 25, 30, 40]), r.choice([10, 15, 20, 25])
        return f"In a class of {c} students, {p}% play a musical instrument and half of the rest play a sport. How many students do neither?"
    if kind == 8:
        a1, d, y = r.randint(8, 30), r.randint(2, 12), r.randint(3, 10)
        return f"{n} is {d} years older than {m}. In {y} years the sum of their ages will be {2 * a1 + d + 2 * y}. How old is each of them now?"
    if kind == 9:
        c, p, d = (
            r.choice([5, 6, 7, 8]),
            r.choice([1.6, 1.8, 1.9, 2.1]),
            r.choice([250, 320, 480, 600]),
        )
        return f"A car uses {c} liters of fuel per 100 km and fuel costs ${p:.2f} per liter. How much does the fuel for a {d} km trip cost?"
    if kind == 10:
        w, d = r.choice([4, 6, 8, 10]), r.choice([6, 9, 12, 15])
        return f"{w} workers can build a wall in {d} days. How many days would {w // 2 * 3} workers need, working at the same rate?"
    if kind == 11:
        red, blue, green = r.randint(3, 8), r.randint(2, 7), r.randint(1, 6)
        return f"A bag holds {red} red, {blue} blue and {green} green marbles. Two marbles are drawn without replacement. What is the probability that both are red?"
    if kind == 12:
        p, rate, y = r.choice([1000, 2500, 5000, 8000]), r.choice([3, 4, 5, 6]), r.randint(2, 6)
        return f"{n} invests ${p} at {rate}% interest compounded once a year. How much is the investment worth after {y} years?"
    if kind == 13:
        up, down, x = r.choice([10, 12, 15]), r.choice([20, 24, 30]), r.randint(6, 20)
        return f"A cyclist rides {x} km uphill at {up} km/h and returns downhill on the same road at {down} km/h. What is the average speed for the round trip?"
    if kind == 14:
        length, width, path = r.randint(8, 20), r.randint(5, 12), r.choice([1, 1.5, 2])
        return f"A garden is {length} m long and {width} m wide. A path {path} m wide runs all the way around the outside. What is the area of the path?"
    e = 2 * r.randint(5, 40)
    return f"Three consecutive even numbers add up to {3 * e + 6}. What are the numbers?"


def math_word() -> list[dict]:
    """Alpaca rows: a fixed instruction plus a generated word problem as the input."""
    r = random.Random(7)
    rows, seen = [], set()
    while len(rows) < 80:
        problem = _math_problem(len(rows) % 16, r)
        if problem in seen:
            continue
        seen.add(problem)
        rows.append({"instruction": MATH_INSTRUCTIONS[len(rows) % 4], "input": problem})
    return rows


# ---------------------------------------------------------------- essays (magicoder-style `instruction`, Parquet)

ESSAY_TOPICS = [
    "how the printing press changed the spread of ideas in Europe",
    "the role of bees in agriculture and what happens if their numbers fall",
    "why cities plant trees along their streets",
    "the history and future of public libraries",
    "what the invention of refrigeration did to diets around the world",
    "the causes and consequences of the 1929 stock market crash",
    "how container shipping reshaped global trade",
    "the ethics of using animals in medical research",
    "why sleep matters for learning and memory",
    "the rise of remote work and its effect on city centres",
    "how the Internet changed the way people find news",
    "the importance of clean drinking water for public health",
    "what makes a good teacher",
    "the impact of social media on teenage friendships",
    "how vaccines changed the course of the twentieth century",
    "the advantages and risks of nuclear power",
    "the cultural significance of food festivals",
    "why learning a second language is worth the effort",
    "how railways shaped the growth of nineteenth-century towns",
    "the challenges of protecting coral reefs",
    "how music affects mood and concentration",
    "the role of failure in scientific discovery",
    "why some languages disappear and how communities revive them",
    "the economics of renewable energy",
    "what the Moon landings meant for ordinary people at the time",
]

PERSUASIVE_CLAIMS = [
    "schools should start later in the morning",
    "every city should have free public transport",
    "homework should be limited in primary school",
    "museums should be free to enter",
    "cooking should be a required subject in secondary school",
    "cities should turn some car lanes into cycle lanes",
    "governments should fund the repair of everyday electronics",
    "a four-day working week would benefit both workers and employers",
    "space exploration deserves more public funding",
    "single-use plastic bags should be banned",
    "children should learn to program before they turn twelve",
    "voting should be compulsory",
    "public parks are as important as hospitals to a city's health",
    "tipping in restaurants should be replaced by higher wages",
    "every town needs a community garden",
]

STORY_PREMISES = [
    "a lighthouse keeper who finds a message in a bottle addressed to her",
    "a robot that wakes up in an abandoned museum",
    "two strangers stuck in a lift during a city-wide blackout",
    "a baker who discovers that her bread lets people remember forgotten days",
    "a boy who trades his shadow for a week of perfect luck",
    "the last train of the night stopping at a station that is not on the map",
    "an old violin that only plays when nobody is listening",
    "a girl who can hear what the trees in her street are saying",
    "a detective who must solve a case using only a child's drawings",
    "a village where it has not rained for ten years until one morning",
    "a postman delivering letters to a town that vanished long ago",
    "an astronaut who receives a phone call from her younger self",
    "a chess match between a grandmother and a travelling stranger",
    "a cat that keeps bringing home keys to houses nobody owns",
    "a map that redraws itself every night",
]

EXPLAINERS = [
    "how compound interest works",
    "what inflation is and why it happens",
    "how a bill becomes law in a parliamentary democracy",
    "what machine learning is and what it is not",
    "how the immune system fights a cold",
    "why the sky is blue and sunsets are red",
    "how an electric motor turns electricity into motion",
    "how encryption keeps online messages private",
    "what a black hole is",
    "how the water cycle works",
]

LETTERS = [
    "a letter to a local council asking for a new pedestrian crossing near a primary school",
    "a speech for the opening of a community library",
    "a graduation speech about curiosity",
    "a letter to your future self to be opened in twenty years",
    "a eulogy for a beloved family dog, warm and a little funny",
    "a cover letter for a first job at a bookshop",
    "a wedding toast from an older sibling",
    "an open letter to a city asking it to protect an old cinema",
    "a welcome speech for new volunteers at a food bank",
    "a retirement tribute to a school caretaker who worked there for thirty years",
]


def essays() -> list[dict]:
    """Long-form writing: essays, persuasive pieces, stories, explainers, letters and speeches."""
    r = random.Random(11)
    out = []
    for topic in ESSAY_TOPICS:
        words = r.choice([150, 200, 250, 300])
        out.append(
            (
                "essay",
                f"Write a short essay of about {words} words on {topic}. Use an introduction, two body paragraphs and a conclusion.",
            )
        )
    for claim in PERSUASIVE_CLAIMS:
        out.append(
            (
                "persuasive",
                f"Write a short persuasive essay of about {r.choice([150, 200, 250])} words arguing that {claim}. Address the strongest counterargument.",
            )
        )
    for premise in STORY_PREMISES:
        out.append(
            (
                "story",
                f"Write a very short story of around {r.choice([150, 200, 250])} words about {premise}. Give it a title.",
            )
        )
    for topic in EXPLAINERS:
        out.append(
            (
                "explainer",
                f"Write a short blog post (about 200 words) for beginners explaining {topic}. Use an everyday analogy and end with a one-sentence summary.",
            )
        )
    for piece in LETTERS:
        out.append(("letter", f"Write {piece}. Aim for roughly {r.choice([120, 150, 200])} words."))
    return [{"instruction": text, "category": cat} for cat, text in out]


# ---------------------------------------------------------------- multi_turn (ultrachat `data`)

CONVERSATIONS = [
    (
        "I'm planning to start running. How often should a beginner run each week?",
        "Most beginners do well with three runs a week on non-consecutive days, at a pace easy enough to hold a conversation. The rest days let muscles and joints adapt.",
        [
            "How long should each of those runs be at first?",
            "What should I eat before an early morning run?",
            "Is it okay to keep running if my knees feel a little sore?",
        ],
    ),
    (
        "How do I keep a sourdough starter alive?",
        "Feed it regularly with equal weights of flour and water, discard part of it before each feeding, and keep it somewhere warm. If you bake rarely, store it in the fridge and feed it once a week.",
        [
            "My starter smells like nail polish remover. What does that mean?",
            "Can I switch it from white flour to rye?",
            "How do I know when it is ready to bake with?",
        ],
    ),
    (
        "What is the best way to start learning Spanish as an adult?",
        "Combine a little structured study, such as a course or textbook, with daily listening and speaking practice. Short sessions every day beat long sessions once a week.",
        [
            "Which tenses should I learn first?",
            "How can I practise speaking if I don't know any Spanish speakers?",
            "How long does it usually take to hold a basic conversation?",
        ],
    ),
    (
        "Which houseplants survive in a room with little light?",
        "Snake plants, ZZ plants, pothos and cast-iron plants all tolerate low light well. They grow slowly in shade, so water them sparingly.",
        [
            "How often should I water a ZZ plant?",
            "Can I use a normal LED bulb to help them grow?",
            "Are any of these safe for cats?",
        ],
    ),
    (
        "What's the difference between git merge and git rebase?",
        "Merge joins two branches with a merge commit and keeps their history as it happened. Rebase replays your commits on top of another branch, giving a linear history but rewriting commits.",
        [
            "When is rebasing a bad idea?",
            "How do I undo a rebase that went wrong?",
            "What does an interactive rebase let me do?",
        ],
    ),
    (
        "I just got my first salary. How should I start budgeting?",
        "Start by tracking where your money goes for a month, then split your income into needs, wants and savings. Many people aim for roughly half on needs and at least a fifth on savings.",
        [
            "Should I pay off my student loan or build savings first?",
            "How big should an emergency fund be?",
            "What is a good app or method for tracking spending?",
        ],
    ),
    (
        "Can you explain photosynthesis in a way a ten-year-old would understand?",
        "Plants make their own food. Their leaves catch sunlight, take in water from the roots and carbon dioxide from the air, and turn them into sugar, giving out oxygen as a leftover.",
        [
            "Why are leaves green, then?",
            "What happens to plants at night?",
            "Can you suggest a simple experiment we could do at home?",
        ],
    ),
    (
        "I work from home and keep getting distracted. Any advice?",
        "Set a fixed start time and a dedicated workspace, plan the day's three most important tasks, and work in focused blocks with short breaks. Keeping your phone in another room helps a lot.",
        [
            "How long should each focus block be?",
            "How do I stop checking email all the time?",
            "What can I do about feeling lonely working alone?",
        ],
    ),
    (
        "Why did the Western Roman Empire fall?",
        "Historians point to several causes working together: political instability, economic trouble, pressure from migrating peoples, and the split between East and West. It was a gradual decline rather than one event.",
        [
            "Why did the Eastern Empire last so much longer?",
            "What role did the army play?",
            "Which primary sources tell us about this period?",
        ],
    ),
    (
        "Should my next car be fully electric or a hybrid?",
        "It depends mostly on your driving and charging. If you can charge at home and mostly drive under a few hundred kilometres a day, an electric car usually costs less to run; a hybrid suits frequent long trips without reliable charging.",
        [
            "How much does battery capacity drop over time?",
            "Is it expensive to install a home charger?",
            "What about driving in very cold winters?",
        ],
    ),
    (
        "How do I write a cover letter that stands out?",
        "Address it to a person if you can, open with why this specific role interests you, and back up two or three claims about your skills with concrete results. Keep it under one page.",
        [
            "How do I explain a two-year gap in my CV?",
            "Should I mention salary expectations?",
            "Can you suggest a strong opening sentence for a marketing role?",
        ],
    ),
    (
        "Is it possible to compost in a small apartment?",
        "Yes. A sealed bokashi bucket or a small worm bin fits under a sink and handles most kitchen scraps without smelling when it is looked after.",
        [
            "What can't I put in a worm bin?",
            "What do I do with the compost if I have no garden?",
            "How do I keep fruit flies away?",
        ],
    ),
    (
        "What is the difference between an inner join and a left join in SQL?",
        "An inner join returns only rows that match in both tables. A left join returns every row from the left table, with NULLs where the right table has no match.",
        [
            "When would I use a full outer join?",
            "Why does my left join return more rows than the left table has?",
            "How do I find rows in one table that have no match in the other?",
        ],
    ),
    (
        "I have trouble falling asleep. What habits help?",
        "Keep a regular wake-up time, get daylight in the morning, avoid caffeine after midday and screens in the last hour before bed, and keep the bedroom cool and dark.",
        [
            "Does reading in bed help or hurt?",
            "Is it bad to nap during the day?",
            "What should I do if I wake up at 3 a.m. and can't get back to sleep?",
        ],
    ),
    (
        "I'm planning a two-week trip to Japan. Where should I start?",
        "Decide on a rough route first; many first-time visitors combine Tokyo, Kyoto and one or two smaller places. Then check whether a rail pass is worth it for that route and book accommodation in the busiest cities early.",
        [
            "Is spring or autumn the better season to go?",
            "How much cash should I carry?",
            "What are some etiquette mistakes to avoid?",
        ],
    ),
    (
        "What's the difference between weather and climate?",
        "Weather is what the atmosphere is doing over hours or days in one place. Climate is the pattern of weather averaged over decades.",
        [
            "So how can scientists predict climate decades ahead if they can't forecast weather a month ahead?",
            "What is a climate normal?",
            "Why do people say a cold winter doesn't disprove global warming?",
        ],
    ),
    (
        "Which chess opening should a beginner learn first?",
        "The Italian Game is a good start for White because it follows the basic principles: control the centre, develop pieces quickly and castle early. Against 1.e4 as Black, 1...e5 leads to similar positions.",
        [
            "What should I play against 1.d4?",
            "How much opening theory should I memorise?",
            "What is the most common beginner mistake in the opening?",
        ],
    ),
    (
        "We're bringing home a new puppy next week. How should we prepare?",
        "Puppy-proof the rooms it will use, set up a crate or bed in a quiet corner, and buy food, bowls, a lead and chew toys. Plan a consistent routine for meals, toilet breaks and sleep from day one.",
        [
            "How do we start toilet training?",
            "When can the puppy meet other dogs?",
            "How do we stop it from biting our hands?",
        ],
    ),
    (
        "Why should I use virtual environments in Python?",
        "A virtual environment gives each project its own set of installed packages, so different projects can depend on different versions without conflicting, and your system Python stays clean.",
        [
            "What's the difference between venv and conda?",
            "How do I record the exact versions I installed?",
            "Should the environment folder go into version control?",
        ],
    ),
    (
        "I get very nervous before public speaking. How can I cope?",
        "Rehearse out loud several times, ideally in front of a friend, and know your first minute by heart. Slow breathing before you start helps, and remember that the audience usually wants you to do well.",
        [
            "What do I do if my mind goes blank halfway through?",
            "Should I use notes or memorise everything?",
            "How can I stop saying 'um' so often?",
        ],
    ),
    (
        "How do vaccines actually work?",
        "A vaccine shows the immune system a harmless version or piece of a germ, so it learns to recognise it. If the real germ arrives later, the body responds faster and more strongly.",
        [
            "What is herd immunity?",
            "Why do some vaccines need booster shots?",
            "How are mRNA vaccines different from older ones?",
        ],
    ),
    (
        "Are index funds a good way to save for retirement?",
        "For many people, yes: they are diversified, cheap to hold and do not rely on picking winners. The main risks are market swings, which matter less over long horizons.",
        [
            "What is an expense ratio and why does it matter?",
            "Should I invest a lump sum or spread it over time?",
            "How does my asset mix change as I get older?",
        ],
    ),
    (
        "How do I make cold brew coffee at home?",
        "Mix coarsely ground coffee with cold water, roughly one part coffee to eight parts water, let it steep in the fridge for 12 to 18 hours, then strain it through a fine filter.",
        [
            "Why does my cold brew taste sour?",
            "How long does it keep in the fridge?",
            "Can I heat cold brew up to drink it hot?",
        ],
    ),
    (
        "What exactly is a black hole?",
        "A black hole is a region where matter is packed so densely that gravity stops anything, even light, from escaping once it crosses the boundary called the event horizon.",
        [
            "How do astronomers find black holes if they can't see them?",
            "What would happen to someone falling into one?",
            "Do black holes last forever?",
        ],
    ),
    (
        "I have a job offer. How do I negotiate the salary?",
        "Research the typical range for the role and location, thank them for the offer, and ask for a specific number near the top of that range with a short reason. Be ready to discuss other benefits if salary is fixed.",
        [
            "What if they say the budget is already final?",
            "Should I mention a competing offer?",
            "Is it okay to negotiate by email rather than by phone?",
        ],
    ),
]


def multi_turn() -> list[dict]:
    """UltraChat rows: question, earlier answer, then one of three follow-ups (the prompt ends on it)."""
    rows = []
    for i, (question, answer, follow_ups) in enumerate(CONVERSATIONS):
        for j, follow in enumerate(follow_ups):
            rows.append({"id": f"uc-{i:02d}-{j}", "data": [question, answer, follow]})
    return rows


# ---------------------------------------------------------------- sharegpt_chat (sharegpt)

CHAT_REQUESTS = [
    (
        "Can you help me write a polite email to {0} {1}?",
        [
            ("my landlord", "asking when the broken heater will be repaired"),
            ("my professor", "asking for an extension on my essay because I was ill"),
            ("a colleague", "declining a meeting invitation because of a deadline"),
            ("my neighbour", "about their dog barking late at night"),
            ("a client", "explaining that the project will be a week late"),
        ],
    ),
    (
        "Give me a {0}-day itinerary for {1} on a {2} budget.",
        [
            ("3", "Lisbon", "modest"),
            ("4", "Mexico City", "mid-range"),
            ("2", "Edinburgh", "tight"),
            ("5", "Seoul", "comfortable"),
            ("4", "Cape Town", "mid-range"),
        ],
    ),
    (
        "Explain {0} like I'm {1}.",
        [
            ("how a blockchain works", "five"),
            ("what a mortgage is", "new to personal finance"),
            ("how Wi-Fi sends data through the air", "twelve"),
            ("the difference between viruses and bacteria", "a high-school student"),
            ("what an API is", "a non-technical manager"),
        ],
    ),
    (
        "What are some good {0} for {1}?",
        [
            ("board games", "a family with young children"),
            ("gifts under $30", "a coworker who loves tea"),
            ("books", "someone who wants to get into science fiction"),
            ("weekend hobbies", "someone who sits at a computer all week"),
            ("names", "a grey kitten"),
        ],
    ),
    (
        'Rewrite this to sound more {0}: "{1}"',
        [
            ("professional", "hey, the report's gonna be late, sorry, stuff came up"),
            ("friendly", "Your request has been received and will be processed in due course."),
            (
                "confident",
                "I think maybe I could possibly lead the project if nobody else wants to?",
            ),
            (
                "concise",
                "At this point in time we are currently in the process of reviewing all of the applications that we have received so far.",
            ),
            ("polite", "Stop parking in front of my garage."),
        ],
    ),
    (
        "I have {0}. What can I cook for dinner tonight?",
        [
            ("eggs, spinach, feta and some stale bread",),
            ("chickpeas, a tin of tomatoes, onions and rice",),
            ("chicken thighs, lemons, garlic and potatoes",),
            ("tofu, broccoli, soy sauce and noodles",),
            ("red lentils, carrots, cumin and a bag of frozen peas",),
        ],
    ),
    (
        "Brainstorm {0} names for {1}.",
        [
            ("10", "a small coffee shop near a university"),
            ("8", "a podcast about local history"),
            ("12", "a budgeting app for students"),
            ("10", "a community running club"),
            ("6", "a handmade candle business"),
        ],
    ),
    (
        "What's the difference between {0} and {1}?",
        [
            ("baking soda", "baking powder"),
            ("a crocodile", "an alligator"),
            ("a Roth IRA", "a traditional IRA"),
            ("latitude", "longitude"),
            ("empathy", "sympathy"),
        ],
    ),
    (
        "How do I {0}?",
        [
            ("get a red wine stain out of a carpet",),
            ("fix a flat bicycle tyre",),
            ("ask my manager for more responsibility",),
            ("back up my phone photos without paying for cloud storage",),
            ("teach my grandmother to make video calls",),
        ],
    ),
    (
        "Write a short {0} about {1}.",
        [
            ("poem", "the first snow of the year"),
            ("limerick", "a forgetful wizard"),
            ("product description", "a waterproof hiking backpack"),
            ("toast", "my best friend's thirtieth birthday"),
            ("bedtime story", "a sleepy dragon who is afraid of the dark"),
        ],
    ),
    (
        "Can you summarise the main ideas of {0} in a few bullet points?",
        [
            ("stoicism",),
            ("the theory of evolution",),
            ("the Marshall Plan",),
            ("agile software development",),
            ("behavioural economics",),
        ],
    ),
    (
        "I'm feeling {0} about {1}. Any advice?",
        [
            ("anxious", "starting a new job on Monday"),
            ("overwhelmed", "planning my wedding"),
            ("stuck", "choosing between two university offers"),
            ("guilty", "not calling my parents often enough"),
            ("unmotivated", "revising for my exams"),
        ],
    ),
    (
        "Plan a {0} for {1}.",
        [
            ("weekly meal plan", "a vegetarian who trains for marathons"),
            ("30-minute workout", "someone with no equipment and a small flat"),
            ("study schedule for the month before exams", "a first-year university student"),
            ("birthday party", "eight-year-olds who love dinosaurs"),
            ("morning routine", "someone who always feels rushed"),
        ],
    ),
    (
        "Pretend you are {0}. {1}",
        [
            ("a tour guide in ancient Rome", "What should I see first?"),
            ("a career coach", "How can I move from teaching into UX design?"),
            ("a museum curator", "Why is this old hand-drawn map so valuable?"),
            ("a personal trainer", "Why am I not getting any stronger?"),
            ("a librarian", "Can you recommend a mystery novel for a long flight?"),
        ],
    ),
    (
        "Compare {0} and {1} for {2}.",
        [
            ("Python", "JavaScript", "a first programming language"),
            ("renting", "buying a flat", "someone who might move in three years"),
            ("the train", "flying", "travelling between Paris and Amsterdam"),
            ("an e-reader", "paper books", "someone who reads every day"),
            ("running", "swimming", "improving general fitness"),
        ],
    ),
]

CHAT_SYSTEMS = [
    "You are a helpful, friendly assistant.",
    "You are a thoughtful assistant. Be practical and specific, and use bullet points when they help.",
    "You are an expert assistant who explains things clearly without jargon.",
    "Keep answers warm and encouraging, but honest.",
]

CHAT_FOLLOW_UPS = [
    (
        "What's a good name for a sourdough starter?",
        'How about "Bubbles McRise"? Other fun options: "Doughbi-Wan", "Yeastie Boy" and "Clint Yeastwood".',
        "Ha, I like Clint Yeastwood. Can you write a two-line poem about him?",
    ),
    (
        "Suggest a title for my blog post about growing tomatoes on a balcony.",
        '"Big Tomatoes, Small Balcony: Growing Food Five Floors Up".',
        "Nice. Now write a three-sentence introduction for that post.",
    ),
    (
        "How many cups of coffee a day is too many?",
        "For most healthy adults, up to about four cups of brewed coffee a day is considered safe, though sensitivity varies a lot between people.",
        "What are the signs I'm having too much?",
    ),
    (
        'Translate "Where is the train station?" into German.',
        '"Wo ist der Bahnhof?"',
        "And how would I ask how much a ticket costs?",
    ),
    (
        "I want to start journaling. What should I write about?",
        "Start small: three things that happened today, one thing you're grateful for, and one thing you'd like to do tomorrow.",
        "What if I miss a few days? I tend to give up on habits quickly.",
    ),
    (
        "Recommend a film for a rainy Sunday afternoon.",
        '"Paddington 2" is hard to beat: funny, kind and beautifully made, and it suits all ages.',
        "Something a bit more grown-up, please, maybe a mystery?",
    ),
]


def sharegpt_chat() -> list[dict]:
    """Everyday assistant requests; every fifth with a system turn, plus a few follow-ups."""
    rows = []
    for template, fills in CHAT_REQUESTS:
        for fill in fills:
            conversation = [{"from": "human", "value": template.format(*fill)}]
            if len(rows) % 5 == 2:
                system = CHAT_SYSTEMS[len(rows) // 5 % len(CHAT_SYSTEMS)]
                conversation.insert(0, {"from": "system", "value": system})
            rows.append({"id": f"sg-{len(rows):03d}", "conversations": conversation})
    for question, answer, follow in CHAT_FOLLOW_UPS:
        conversation = [
            {"from": "human", "value": question},
            {"from": "gpt", "value": answer},
            {"from": "human", "value": follow},
        ]
        rows.append({"id": f"sg-{len(rows):03d}", "conversations": conversation})
    return rows


# ---------------------------------------------------------------- alpaca_tasks (alpaca)

PARAGRAPHS = [
    "The town council voted on Tuesday to close the old swimming pool at the end of the summer. Repairs to the roof and the heating system would cost more than building a new pool, councillors said. A smaller pool will open next to the sports centre in two years, and residents can use the school pool on weekends in the meantime.",
    "Octopuses have three hearts and blue blood. Two of the hearts pump blood through the gills, while the third sends it to the rest of the body. Their blood uses a copper-based protein to carry oxygen, which works better than iron in cold water with little oxygen.",
    "Our team spent the last quarter moving the billing system to a new database. The migration finished two weeks late because of unexpected data quality problems, but customers saw no downtime. Monthly hosting costs have fallen by about a third since the switch.",
    "Walking for thirty minutes a day can lower blood pressure, improve mood and help with sleep. Researchers found that the benefits appear even when the thirty minutes are split into three shorter walks. Walking briskly enough to feel slightly out of breath gives the most benefit.",
    "The bakery on Mill Street has been run by the same family for four generations. It still uses a wood-fired oven built in 1921, and the queue for its rye bread starts before seven on Saturdays. The owners say they will not open a second shop because they want to keep baking everything themselves.",
    "Honey never really spoils. Its low water content and high acidity make it hard for bacteria to grow, and bees add an enzyme that produces small amounts of hydrogen peroxide. Honey can crystallise over time, but gentle warming turns it liquid again.",
    "The new bus timetable starts on 1 March. Route 12 will run every ten minutes during rush hour instead of every fifteen, but the late-night service after midnight will be cut. The transport company says passenger surveys showed very few people used the late buses.",
    "Glaciers in the Alps lost a record share of their ice last year. A dry winter left little snow to protect them, and summer heatwaves melted the ice quickly. Scientists warn that many smaller Alpine glaciers may disappear by the end of the century.",
]

TRANSLATIONS = [
    ("French", "The museum is closed on Mondays."),
    ("Spanish", "Could you tell me where the nearest pharmacy is?"),
    ("German", "I have been learning to play the piano for two years."),
    ("Italian", "We would like a table for four people at eight o'clock."),
    ("Portuguese", "The weather will be sunny tomorrow afternoon."),
    ("Dutch", "My brother lives in a small house near the sea."),
    ("French", "Please turn off your phone during the performance."),
    ("Spanish", "The train to the airport leaves every twenty minutes."),
]

REVIEWS = [
    "The headphones sound great and the battery lasts all week. Best purchase I've made this year.",
    "It arrived broken and customer service never answered my emails.",
    "The hotel room was spotless and the staff were lovely, but the street noise kept us awake.",
    "Decent pasta, slow service, and the prices were higher than I expected.",
    "This blender is powerful, quiet and easy to clean. I use it every morning.",
    "The book started strong, but the ending felt rushed and left too many questions.",
    "Absolutely useless. The app crashes every time I try to log in.",
    "Comfortable shoes, though they took a week to break in.",
]

GRAMMAR = [
    "Me and him goes to the market every saturdays.",
    "She don't know nothing about the meeting tomorow.",
    "Their going to there friends house after they finish they're homework.",
    "The datas shows that less people is using cash.",
    "I seen that film allready, it were boring.",
    "Each of the students have their own laptop's.",
    "We was suppose to arrive at 5 but the train were late.",
    "Who's book is this, and who's going to returns it?",
]

PASSIVE = [
    "The chef prepared a special dessert for the guests.",
    "The storm damaged several houses near the coast.",
    "Our neighbours planted three apple trees last spring.",
    "The committee will announce the winners on Friday.",
    "A young architect designed the new library.",
    "The children painted the fence bright yellow.",
]

ANIMALS = ["dolphin", "salamander", "penguin", "gecko", "bat", "salmon", "platypus", "tortoise"]

NO_INPUT_TASKS = [
    "List five tips for saving energy at home.",
    'Give three synonyms for the word "happy".',
    "Write a haiku about an autumn morning.",
    "Explain the difference between a simile and a metaphor.",
    "Name three renewable sources of energy.",
    "Suggest four questions to ask at the end of a job interview.",
    "Describe the taste of a lemon to someone who has never had one.",
    'Give an example of a sentence that uses the word "ephemeral".',
    "List the planets of the solar system in order from the Sun.",
    "Write a two-sentence horror story.",
    "Generate a catchy slogan for a bicycle repair shop.",
    "Explain what a prime number is in one sentence.",
    "Name five fruits that are high in vitamin C.",
    "Write a short thank-you note to a teacher.",
    "Give three reasons why people keep a diary.",
    "Describe a sunset using all five senses.",
    "List four things to pack for a day hike.",
    "Suggest a name for a friendly robot that works in a library.",
    "Explain in simple terms what a budget is.",
    "Give two arguments for and two against school uniforms.",
]


def alpaca_tasks() -> list[dict]:
    """Short instruction-following tasks, with and without an input text."""
    rows = []
    for text in PARAGRAPHS:
        rows.append(
            {"instruction": "Summarize the following paragraph in one sentence.", "input": text}
        )
    for text in PARAGRAPHS:
        rows.append(
            {
                "instruction": "Extract the five most important keywords from this text.",
                "input": text,
            }
        )
    for language, sentence in TRANSLATIONS:
        rows.append(
            {"instruction": f"Translate the following sentence into {language}.", "input": sentence}
        )
    for review in REVIEWS:
        rows.append(
            {
                "instruction": "Classify the sentiment of this review as positive, negative or mixed.",
                "input": review,
            }
        )
    for sentence in GRAMMAR:
        rows.append(
            {
                "instruction": "Correct the grammar and spelling in the following sentence.",
                "input": sentence,
            }
        )
    for sentence in PASSIVE:
        rows.append(
            {"instruction": "Rewrite the sentence in the passive voice.", "input": sentence}
        )
    for animal in ANIMALS:
        rows.append(
            {
                "instruction": "Is this animal a mammal, bird, reptile, amphibian or fish? Answer in one word.",
                "input": animal,
            }
        )
    for task in NO_INPUT_TASKS:
        rows.append({"instruction": task, "input": ""})
    return rows


# ---------------------------------------------------------------- main


def main() -> None:
    """Write all eight files and print how many rows each has."""
    import polars as pl

    files = {
        "chat_general.jsonl": chat_general(),
        "code_instruct.jsonl": code_instruct(),
        "code_problems.jsonl": code_problems(),
        "multi_turn.jsonl": multi_turn(),
        "sharegpt_chat.jsonl": sharegpt_chat(),
        "alpaca_tasks.jsonl": alpaca_tasks(),
    }
    for name, rows in files.items():
        write_jsonl(name, rows)
    math = math_word()
    (HERE / "math_word.json").write_text(
        json.dumps(math, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
    )
    essay_rows = essays()
    pl.DataFrame(essay_rows).write_parquet(HERE / "essays.parquet", statistics=False)
    files.update({"math_word.json": math, "essays.parquet": essay_rows})
    for name, rows in sorted(files.items()):
        print(f"{name:22s} {len(rows):4d} rows")


if __name__ == "__main__":
    main()
